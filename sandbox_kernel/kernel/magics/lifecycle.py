"""%sandbox commands that change which sandbox runs and what becomes of it: pause, resume,
fork, attach, list, keep, on-shutdown."""

from __future__ import annotations

import argparse
import time

from sandbox_kernel.api import names
from sandbox_kernel.kernel.magics.family import MagicFamily
from sandbox_kernel.kernel.magics.parsing import MagicError
from sandbox_kernel.kernel.magics.tables import describe_age, table
from sandbox_kernel.sandbox import ownership


class LifecycleMagics(MagicFamily):
    async def pause(self, _: argparse.Namespace) -> None:
        await self.transition("Pausing", self.session.pause, "paused")

    async def resume(self, _: argparse.Namespace) -> None:
        await self.transition("Resuming", self.session.resume, "running again")

    async def list_sandboxes(self, _: argparse.Namespace) -> None:
        views = await self.session.list_sandboxes()
        if not views:
            self.out.text(f"no sandboxes on {self.session.settings.description}\n")
            return
        rows = [(v.id + (" (this notebook)" if v.id == self.session.sandbox_id else ""),
                 f"{names.display_name(v)}, {v.status.value}, {v.shape or '?'}, {describe_age(v.created_at)} old"
                 + (f", forked from {v.forked_from}" if v.forked_from else "")
                 + f", owner: {ownership.describe_owner(v.id, v.name)}" + self._outlives(v.id))
                for v in views]
        self.out.display(table(rows))

    def _outlives(self, sandbox_id: str) -> str:
        """The mark of a sandbox that will still exist (and cost) after this notebook: kept
        ones, and this notebook's own when its policy pauses or keeps them. At shutdown the
        kernel's last words list them again, but JupyterLab shows no output then."""
        if ownership.is_kept(sandbox_id):
            return f"; KEPT: outlives its notebook (sandbox-kernel rm {sandbox_id} destroys it)"
        if self.session.on_shutdown != "destroy" and ownership.owns(sandbox_id):
            return f"; outlives this notebook (on shutdown: {self.session.on_shutdown})"
        return ""

    async def fork(self, args: argparse.Namespace) -> None:
        started = time.monotonic()
        parent = self.session.sandbox_id
        line = self.out.progress(f"Forking sandbox {parent}…")
        paused_first = ""

        def pausing_first(text: str) -> None:  # on the fork's own line, so the result stays last
            nonlocal paused_first
            paused_first = f"; {parent} was paused first"
            line.headline = text
            line.update(text)

        child = await self.session.fork(args.name, progress=line, on_pause=pausing_first)
        label = f" ({args.name})" if args.name else ""
        line.update(f"Forked {parent} into {child.id}{label} in {time.monotonic() - started:.1f} s{paused_first}")
        ref = args.name or child.id
        if args.switch:
            await self.session.attach(child.id, progress=line)
            self.out.text(f"This notebook now drives the fork {child.id}; the original {parent} stays "
                          f"paused (%sandbox attach {parent} to go back)\n")
        else:
            self.out.text(f"{parent} stays paused until your next cell. Open the fork from another "
                          f"notebook with `%sandbox attach {ref}`, or start a kernel with "
                          f"SANDBOX_KERNEL_SANDBOX_ID={ref}\n")

    async def attach(self, args: argparse.Namespace) -> None:
        previous = self.session.sandbox_id
        args.sandbox_id = (await self.session.find(args.sandbox_id)).id
        if args.sandbox_id == previous:
            if not args.restart_runner:
                raise MagicError(f"%sandbox attach: this notebook already drives {previous}")
            line = self.out.progress(f"Restarting the Python runner in sandbox {previous}…")
            await self.session.attach(previous, fresh_runner=True, progress=line)
            line.update(f"Restarted the Python runner in sandbox {previous}: variables and imports "
                        "are gone, files are kept")
            return
        line = self.out.progress(f"Attaching to sandbox {args.sandbox_id}…")
        kept = await self.session.attach(args.sandbox_id, fresh_runner=args.restart_runner, progress=line)
        state = "its Python state kept" if kept else "a fresh Python started"
        line.update(f"This notebook now drives sandbox {args.sandbox_id} ({state})")
        if other_version := self.session.other_version_line():
            self.out.text(other_version + "\n")
        if previous and args.destroy_previous:
            await self.session.destroy(previous)
            self.out.text(f"Destroyed the previous sandbox {previous}\n")
        elif previous:
            self.out.text(f"The previous sandbox {previous} stays "
                          f"(%sandbox attach {previous} to go back)\n")

    async def keep(self, args: argparse.Namespace) -> None:
        view = await self.session.find(args.sandbox_id) if args.sandbox_id else await self.session.view()
        if not ownership.owns(view.id):
            raise MagicError(f"%sandbox keep: {view.id} is not this notebook's to hand off "
                             "(it was attached, or is kept already)")
        self.session.keep(view.id)
        self.out.text(f"Sandbox {view.id} ({names.display_name(view)}) is kept: it outlives this notebook "
                      f"and gc leaves it; `sandbox-kernel rm {view.id}` destroys it\n")

    async def on_shutdown(self, args: argparse.Namespace) -> None:
        self.session.set_on_shutdown(args.policy)
        outcome = {"destroy": "destroyed", "pause": "paused", "keep": "kept"}[args.policy]
        owned = ownership.owned_here()
        which = (f"sandbox {owned[0]}" if len(owned) == 1 else
                 f"its sandboxes {', '.join(owned)}" if owned else "no sandbox (it owns none)")
        self.out.text(f"When this notebook shuts down, {which} will be {outcome}\n")
