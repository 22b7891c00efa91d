"""A parameter sweep over forks: a sandbox whose Python holds the expensive state (data
loaded, a model built) is forked once per combination of parameter values, and each fork
goes on from that live state with its own values, several at once.

`sweep()` is the whole life of the forks, for any caller: `sandbox-kernel sweep` (cli/sweep.py
runs each branch as the rest of a notebook on a kernel attached to the fork) and a magic that
sweeps one cell (it would call sweep() with its own session and a run_branch of its own). It
forks one branch at a time (CreateOS forks only a paused source; the source stays paused),
runs at most `jobs` branches at once, and destroys every fork at the end, also when it is
cancelled (Ctrl-C): a fork being made then is waited for and destroyed too.

Each fork is owned (ownership.py) from its first moment: by the caller's kernel, or by the
live kernel `owner` (the command line's setup kernel), until run_branch hands it on.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sandbox_kernel.api import NotFoundError, SandboxAPIError, SandboxView
from sandbox_kernel.api import names
from sandbox_kernel.config import ConfigError
from sandbox_kernel.sandbox import ownership
from sandbox_kernel.sandbox.session import SandboxSession

log = logging.getLogger("sandbox_kernel.sandbox.sweep")

OK, FAILED, CANCELLED = "ok", "failed", "cancelled"


class SweepError(ConfigError):
    """The sweep cannot start as asked; the message is one line."""


@dataclass(frozen=True)
class Branch:
    index: int  # from 0, in the order of the combinations
    parameters: dict[str, Any]

    @property
    def label(self) -> str:
        return ", ".join(f"{name}={value!r}" for name, value in self.parameters.items())


@dataclass
class Outcome:
    branch: Branch
    status: str  # OK, FAILED or CANCELLED
    seconds: float = 0.0
    error: str | None = None  # one line, for FAILED
    collected: dict[str, str] = field(default_factory=dict)  # variable -> its repr (untrusted text)
    sandbox_id: str | None = None


RunBranch = Callable[[Branch, SandboxView], Awaitable[Outcome]]


def parse_value(text: str) -> Any:
    """A value from the command line, read as papermill's `-p NAME VALUE` reads it."""
    if text in ("True", "False", "None"):
        return {"True": True, "False": False, "None": None}[text]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parameter_source(parameters: dict[str, Any]) -> str:
    """The injected cell's source, as papermill writes it for Python."""
    return "# Parameters\n" + "".join(f"{name} = {_literal(value)}\n" for name, value in parameters.items())


def _literal(value: Any) -> str:
    if isinstance(value, str):  # papermill's spelling: double quotes, escapes as unicode_escape writes them
        return '"' + value.encode("unicode_escape").decode("utf-8").replace('"', '\\"') + '"'
    if isinstance(value, float) and value != value:
        return "float('nan')"
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return f"float('{'-' if value < 0 else ''}inf')"
    return repr(value)


def grid_of(pairs: Sequence[Sequence[str]]) -> dict[str, list[Any]]:
    """-p NAME VALUE [VALUE ...] options as name -> values, checked."""
    grid: dict[str, list[Any]] = {}
    for name, *values in pairs:
        if not name.isidentifier() or name in grid:
            raise SweepError(f"-p {name}: {'given twice' if name in grid else 'not a Python variable name'}")
        if not values:
            raise SweepError(f"-p {name}: give at least one value")
        grid[name] = [parse_value(value) for value in values]
    if not grid:
        raise SweepError("give the parameters to sweep: -p NAME VALUE [VALUE ...]")
    return grid


def combinations(grid: Mapping[str, Sequence[Any]]) -> list[Branch]:
    """One branch per combination (the product of the value lists, in their order)."""
    keys = list(grid)
    return [Branch(index, dict(zip(keys, values)))
            for index, values in enumerate(itertools.product(*(grid[key] for key in keys)))]


async def sweep(source: SandboxSession, branches: Sequence[Branch], run_branch: RunBranch, jobs: int,
                owner: int | None = None, on_outcome: Callable[[Outcome], None] | None = None,
                keep: bool = False) -> list[Outcome]:
    """Run every branch in its own fork of `source` (at most `jobs` at once) and destroy
    the forks (with `keep`, those of the branches that ended stay, for the caller to keep);
    return the outcomes in branch order. A failing branch does not stop the others;
    run_branch's exception is its branch's one-line error."""
    slots = asyncio.Semaphore(max(1, jobs))
    forking = asyncio.Lock()  # one fork at a time: the source is paused once, then forked
    outcomes: dict[int, Outcome] = {}
    forks: list[str] = []
    kept: set[str] = set()

    async def one(branch: Branch) -> None:
        async with slots:
            started = time.monotonic()
            view: SandboxView | None = None
            try:
                async with forking:
                    view = await _fork(source, owner, forks)
                outcome = await run_branch(branch, view)
            except Exception as exc:  # the branch's failure, not the sweep's
                outcome = Outcome(branch, FAILED, error=_one_line(exc))
            outcome.seconds = outcome.seconds or time.monotonic() - started
            outcomes[branch.index] = outcome
            if view is not None:
                outcome.sandbox_id = view.id
                if keep:
                    kept.add(view.id)
                else:
                    await _destroy(source, view.id)
            if on_outcome is not None:
                on_outcome(outcome)

    try:
        async with asyncio.TaskGroup() as group:
            for branch in branches:
                group.create_task(one(branch))
    finally:
        # Every fork, whatever happened: cancelled branches' included (each is gone already
        # when its branch ended normally: then this only makes sure).
        await asyncio.shield(asyncio.gather(*(_destroy(source, sandbox_id) for sandbox_id in forks
                                              if sandbox_id not in kept)))
    return [outcomes.get(branch.index) or Outcome(branch, CANCELLED) for branch in branches]


async def _fork(source: SandboxSession, owner: int | None, forks: list[str]) -> SandboxView:
    """Fork the source; a cancel while the fork is made waits for it (so that its id is
    known and it is destroyed), then goes on."""
    making = asyncio.ensure_future(source.fork(owner=owner))
    try:
        view = await asyncio.shield(making)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            forks.append((await making).id)
        raise
    forks.append(view.id)
    return view


async def _destroy(source: SandboxSession, sandbox_id: str) -> None:
    """Destroy a fork (gone already is fine); a failure is logged and leaves it owned, so
    that `sandbox-kernel gc` finds it."""
    try:
        await source.destroy(sandbox_id)
    except NotFoundError:
        ownership.forget(sandbox_id)
    except SandboxAPIError as exc:
        try:
            gone = sandbox_id not in {view.id for view in names.live(await source.list_sandboxes())}
        except SandboxAPIError:
            gone = False
        if gone:
            ownership.forget(sandbox_id)
        else:
            log.warning("could not destroy fork %s: %s", sandbox_id, exc.user_message())


def _one_line(exc: BaseException) -> str:
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
    return text if type(exc).__name__ in text else f"{type(exc).__name__}: {text}"
