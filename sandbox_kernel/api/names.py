"""Sandbox names that work from every notebook, `ls`, `rm` and attach.

A created sandbox carries its name in the provider's `name` field (unique per user on
CreateOS). A fork cannot: the fork body has no name and PATCH cannot set one. So a named
fork carries its name the only way the API lets a fork carry anything readable: the NAME of
an environment variable (views list env names, never values), SANDBOX_KERNEL_NAME_<name>
with '-' written '_'. Such a fork's `name` field is the provider's generated one; both
resolve. Fork envs replace the source's, so a name is given only to forks of sandboxes
with no environment variables of their own (names.fork_envs says so, one line).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from sandbox_kernel.api import SandboxStatus, SandboxView

NAME_ENV = "SANDBOX_KERNEL_NAME_"
VALID = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
GONE = (SandboxStatus.DESTROYING, SandboxStatus.DESTROYED, SandboxStatus.FAILED)


class SandboxNameError(Exception):
    """A name problem the user can fix; the message is one line."""


def checked(name: str) -> str:
    if not VALID.match(name):
        raise SandboxNameError(f"bad sandbox name {name!r}: use 1-63 lowercase letters, digits and '-', "
                         "starting with a letter or digit")
    return name


def env_for(name: str) -> str:
    return NAME_ENV + name.replace("-", "_")


def names_of(view: SandboxView) -> list[str]:
    """Every name the sandbox answers to: the one given to its fork first, then its own."""
    given = [env[len(NAME_ENV):].replace("_", "-") for env in view.envs or [] if env.startswith(NAME_ENV)]
    return given + ([view.name] if view.name else [])


def display_name(view: SandboxView) -> str:
    return (names_of(view) or ["-"])[0]


def fork_envs(source: SandboxView, name: str | None,
              known: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """The envs to send with a fork of `source`: None inherits the source's, a dict
    replaces them. The source's own name marker never passes to an unnamed fork. `known`:
    values of the source's envs the caller can give again (a view has only their names),
    which a named fork keeps."""
    known = known or {}
    own_envs = [env for env in source.envs or [] if not env.startswith(NAME_ENV)]
    marked = len(own_envs) < len(source.envs or [])
    given = {env: known[env] for env in own_envs if env in known}
    if name is None:
        return given if marked and len(given) == len(own_envs) else None
    if len(given) < len(own_envs):
        raise SandboxNameError(f"cannot name a fork of {source.id}: it has environment variables "
                         f"({', '.join(env for env in own_envs if env not in given)}) that a named fork "
                         "would lose (a fork takes a name only through its env vars); fork without --name")
    return {**given, env_for(name): name}


def live(views: list[SandboxView]) -> list[SandboxView]:
    return [view for view in views if view.status not in GONE]


def taken_by(views: list[SandboxView], name: str) -> SandboxView | None:
    return next((view for view in live(views) if name in names_of(view)), None)


def lookup(views: list[SandboxView], ref: str) -> list[SandboxView]:
    """The sandboxes `ref` designates: the one with that id, else the live ones of that name."""
    return [view for view in views if view.id == ref] or [view for view in live(views) if ref in names_of(view)]


def resolve(views: list[SandboxView], ref: str, where: str) -> SandboxView:
    """The sandbox `ref` (an id or a name) designates, or one line saying why none does."""
    found = lookup(views, ref)
    if len(found) == 1:
        return found[0]
    if found:
        raise SandboxNameError(f"several sandboxes are called {ref!r} on {where}: "
                               f"{', '.join(view.id for view in found)}; use an id")
    raise SandboxNameError(f"no sandbox with id or name {ref!r} on {where}")
