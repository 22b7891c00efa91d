"""What the Sandboxes panel shows and does, on the host: every sandbox of the provider the
Jupyter server's environment selects (the local engine of its state dir, or CreateOS),
with its owner, state, age, cost; pause, resume, fork, keep, destroy; a sandbox's egress
rules and refusals. Notebook-side facts (which kernel is which notebook) come from
notebooks.py; this module knows no HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from sandbox_kernel.api import SandboxClient, SandboxView, names
from sandbox_kernel.api import egress_rules
from sandbox_kernel.api.models import ForkSandboxRequest, PatchSandboxRequest, SandboxStatus
from sandbox_kernel.config import DEFAULT_AUTO_PAUSE, EngineNotRunning, Settings, open_client
from sandbox_kernel.sandbox import host_pip_settings, ownership, pool
from sandbox_kernel.sandbox.cost import Meter
from sandbox_kernel.sandbox.listing import Listed, describe_age, listing

SETTLE_TIMEOUT = 120.0  # for a pause before a fork (a large CreateOS VM takes seconds)
SETTLE_POLL = 0.2


class PanelError(Exception):
    """One line for the panel; status is the HTTP status the handler answers with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Owners:
    """Which notebook (path) each live kernel of this Jupyter server is, by pid, and which
    sandbox each of those kernels drives now (ownership.drive)."""

    notebook_of_pid: dict[int, str]
    driving: dict[int, str]


class Sandboxes:
    def __init__(self, settings: Settings | None = None) -> None:
        self._settings = settings
        # One meter for the server's life: it learns each sandbox's history from every listing.
        self.meter = Meter()

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            self._settings = Settings.from_env()  # a ConfigError is the panel's one line
        return self._settings

    @contextlib.asynccontextmanager
    async def client(self) -> AsyncIterator[SandboxClient]:
        """A client for one request; the panel never starts a local engine (it would keep it alive)."""
        client = await open_client(self.settings, start_engine=False)
        async with client:
            yield client

    # -- reading ----------------------------------------------------------------------------

    async def listing(self, owners: Owners) -> dict[str, Any]:
        settings = self.settings
        try:
            async with self.client() as client:
                views = await client.list_sandboxes()
        except EngineNotRunning:
            return {"provider": settings.description, "sandboxes": [],
                    "note": "the local engine is not running: it starts with the first sandbox notebook"}
        rows = [self.row(listed, owners) for listed in listing(names.live(views), self.meter)]
        book = self.meter.prices
        return {"provider": settings.description, "sandboxes": rows,
                "prices": f"CreateOS, {book.dated}",
                "note": ("local sandboxes are free: costs are what they would be on CreateOS"
                         if settings.provider == "local" else "")}

    @staticmethod
    def row(listed: Listed, owners: Owners) -> dict[str, Any]:
        view, owner = listed.view, listed.owner
        if owner is None:
            owner_json = {"kind": "warm pool", "label": "warm pool"}
        elif owner.kind == "kernel" and owner.pid in owners.notebook_of_pid:
            owner_json = {"kind": "notebook", "label": owners.notebook_of_pid[owner.pid]}
        else:
            owner_json = {"kind": owner.kind, "label": {"orphaned": "orphaned (its kernel is gone)",
                                                         "none": "-"}.get(owner.kind, str(owner))}
        return {"id": view.id, "name": listed.name, "status": view.status.value,
                "shape": view.shape or f"{view.vcpu} vCPU, {view.mem_mib} MiB",
                "vcpu": float(view.vcpu), "mem_mib": view.mem_mib,
                "created_at": view.created_at, "age": describe_age(view.created_at),
                "forked_from": view.forked_from, "owner": owner_json,
                "cost_per_hour": listed.per_hour, "cost_so_far": listed.cost.total,
                "driven_by": [owners.notebook_of_pid[pid] for pid, sandbox_id in owners.driving.items()
                              if sandbox_id == view.id]}

    async def view(self, client: SandboxClient, ref: str) -> SandboxView:
        views = await client.list_sandboxes()
        try:
            return names.resolve(names.live(views), ref, self.settings.description)
        except names.SandboxNameError as exc:
            raise PanelError(str(exc), 404) from None

    # -- actions ----------------------------------------------------------------------------

    async def pause(self, ref: str) -> str:
        return await self._switch(ref, SandboxStatus.RUNNING, "paused")

    async def resume(self, ref: str) -> str:
        return await self._switch(ref, SandboxStatus.PAUSED, "resumed")

    async def _switch(self, ref: str, needed: SandboxStatus, done: str) -> str:
        """Pause a running sandbox or resume a paused one; any other state is one 409 line."""
        async with self.client() as client:
            view = await self.view(client, ref)
            if view.status != needed:
                raise PanelError(f"sandbox {view.id} is {view.status.value}: only a {needed.value} one "
                                 f"can be {done}", 409)
            switch = client.pause_sandbox if needed == SandboxStatus.RUNNING else client.resume_sandbox
            return (await switch(view.id)).status.value

    async def keep(self, ref: str) -> str:
        async with self.client() as client:
            view = await self.view(client, ref)
        if view.id in pool.all_members():
            raise PanelError(f"sandbox {view.id} is a warm pool member: it belongs to no notebook yet", 409)
        ownership.keep(view.id)
        return "kept"

    async def destroy(self, ref: str) -> str:
        async with self.client() as client:
            view = await self.view(client, ref)
            result = await client.delete_sandbox(view.id)
        ownership.forget(view.id, view.name)
        pool.forget(view.id)
        self.meter.note_gone(view.id)
        return result.status.value

    async def fork(self, ref: str, name: str | None) -> dict[str, str]:
        """Fork `ref` (paused first, as CreateOS forks only paused sandboxes: it stays paused,
        its notebook's next cell resumes it). The fork belongs to no kernel: it is kept, so
        gc leaves it and no notebook's shutdown destroys it ("open in a new notebook" drives it)."""
        async with self.client() as client:
            views = await client.list_sandboxes()
            try:
                source = names.resolve(names.live(views), ref, self.settings.description)
                # A sandbox the kernel made carries the host's pip settings as envs, which a
                # named fork must be given again (names.fork_envs): this host's, as the kernel's.
                envs = names.fork_envs(source, names.checked(name) if name else None,
                                       host_pip_settings.for_sandbox(self.settings).envs)
                if name and (holder := names.taken_by(views, name)):
                    raise PanelError(f"the name {name!r} is taken by sandbox {holder.id}: choose another", 409)
            except names.SandboxNameError as exc:
                raise PanelError(str(exc)) from None
            if source.status == SandboxStatus.RUNNING:
                await client.pause_sandbox(source.id)
            await self._settle(client, source.id, SandboxStatus.PAUSED)
            child = await client.fork_sandbox(source.id, ForkSandboxRequest(envs=envs))
            ownership.keep(child.id)
            view = await self._settle(client, child.id, SandboxStatus.RUNNING)
            if view.auto_pause_after_seconds is None:
                await client.patch_sandbox(view.id, PatchSandboxRequest(
                    auto_pause_after_seconds=self.settings.auto_pause or DEFAULT_AUTO_PAUSE))
        return {"id": child.id, "name": name or names.display_name(view)}

    async def _settle(self, client: SandboxClient, sandbox_id: str, wanted: SandboxStatus) -> SandboxView:
        deadline = time.monotonic() + SETTLE_TIMEOUT
        while True:
            view = await client.get_sandbox(sandbox_id)
            if view.status == wanted:
                return view
            if view.status.is_gone or view.status == SandboxStatus.ERROR:
                raise PanelError(f"sandbox {sandbox_id} is {view.status.value}", 409)
            if time.monotonic() > deadline:
                raise PanelError(f"sandbox {sandbox_id} is still {view.status.value} after "
                                 f"{SETTLE_TIMEOUT:.0f} s", 504)
            await asyncio.sleep(SETTLE_POLL)

    # -- egress ---------------------------------------------------------------------------

    async def egress(self, ref: str) -> dict[str, Any]:
        async with self.client() as client:
            view = await self.view(client, ref)
            egress = await client.get_egress(view.id)
        return self._egress_json(egress)

    async def set_egress(self, ref: str, typed: list[str]) -> dict[str, Any]:
        """Replace the rules with `typed`, validated as %egress validates them ([] allows
        every public destination)."""
        rules = checked(typed) if typed else []
        async with self.client() as client:
            view = await self.view(client, ref)
            return self._egress_json(await client.set_egress(view.id, rules))

    async def block_all(self, ref: str) -> dict[str, Any]:
        """Refuse every destination: CreateOS has no deny-all word, so one rule that matches
        nothing (egress_rules.DENY_ALL), as `%egress block-all` sets."""
        async with self.client() as client:
            view = await self.view(client, ref)
            return self._egress_json(await client.set_egress(view.id, [egress_rules.DENY_ALL]))

    async def allow(self, ref: str, target: str) -> dict[str, Any]:
        """Allow one refused destination (host:port as the refusal names it), as `%egress
        allow` does. Only a destination the log refused, and only one destination: the
        target came from the sandbox (the rules editor is there for anything else)."""
        if not egress_rules.is_one_destination(target):
            raise PanelError(f"{target!r} is not one destination (host:port): use the rules editor")
        rule = checked([target])
        async with self.client() as client:
            view = await self.view(client, ref)
            egress = await client.get_egress(view.id)
            if target.lower() not in {f"{d.host}:{d.port}".lower() for d in egress.denied or []}:
                raise PanelError(f"{target} is not among the latest refusals of {view.id}", 409)
            rules, narrowed = egress_rules.allowing(egress.egress or [], rule)
            answer = self._egress_json(await client.set_egress(view.id, rules))
        if narrowed:
            answer["note"] = (f"allowed {rule[0]}; this was: all public destinations, so every other "
                              "destination is now refused")
        return answer

    @staticmethod
    def _egress_json(view: Any) -> dict[str, Any]:
        rules = view.egress or []
        return {"rules": rules, "block_all": rules == [egress_rules.DENY_ALL],
                "denied_count": view.denied_count,  # None: the provider reports none (CreateOS)
                "denied": [{"at": d.at, "host": d.host, "port": d.port, "reason": d.reason}
                           for d in (view.denied or [])[-20:]][::-1]}


def checked(typed: list[str]) -> list[str]:
    if not isinstance(typed, list) or not all(isinstance(rule, str) for rule in typed):
        raise PanelError("rules must be a list of strings")
    try:
        return egress_rules.typed(typed)
    except egress_rules.EgressRuleError as exc:
        raise PanelError(str(exc)) from None
