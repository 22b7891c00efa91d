"""The sandbox's start, as the kernel sees it: begun as soon as the kernel starts (taking
over the sandbox made early, while ipykernel was imported, or the one a restarting kernel
handed off), waited for by the first cell, which shows a progress line only if the wait is
long (a cell shows no output the user did not ask for: where the sandbox runs is in the
banner, the log and `%sandbox status`). A failed start is tried again by the next cell.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from sandbox_kernel.config import Settings
from sandbox_kernel.kernel.output import CellOutput
from sandbox_kernel.sandbox import early_start, ownership
from sandbox_kernel.sandbox.session import SandboxSession, SessionError

if TYPE_CHECKING:
    from sandbox_kernel.kernel.handlers import SandboxKernel

log = logging.getLogger("sandbox_kernel.kernel.boot")

# A cell that waits longer than this for the sandbox to start shows a progress line.
SLOW_START = 2.0
# kernel_info and debug requests wait this long for a starting sandbox (to report its Python
# and what it can do).
KERNEL_INFO_WAIT = 10.0
# Shutting down while the sandbox still starts: wait this long for it (jupyter_client kills
# a kernel that takes 5 s), then stop waiting and find the sandbox by its name (shutdown_policy.py).
BOOT_SHUTDOWN_WAIT = 2.0


class Boot:
    """The start of this kernel's sandbox session (one task; another after a failure)."""

    def __init__(self, kernel: SandboxKernel, settings: Settings | None, config_error: str | None) -> None:
        self.kernel = kernel
        self.settings = settings
        self.config_error = config_error
        self.session: SandboxSession | None = None
        self.task: asyncio.Task[None] | None = None
        self.ready_shown = False  # the opt-in ready line (show_ready), shown once
        # Started attached to a sandbox whose runner is of another version: its one line,
        # which the first cell shows (session.other_version_line).
        self.other_version_line: str | None = None

    def begin(self, loop: asyncio.AbstractEventLoop) -> None:
        self.task = loop.create_task(self._start())

    async def _start(self) -> None:
        if self.settings is None:
            raise SessionError(self.config_error or "invalid configuration")
        self.session = SandboxSession(self.settings, on_background=self.kernel.events.background_event,
                                      on_runner_died=self.kernel.shutdown.runner_died_between_cells)
        handoff = self.kernel.handoff.take()
        if handoff:  # a restart: same sandbox, fresh Python (see hand_off), same shutdown policy and sandboxes
            for sandbox_id in handoff.get("owned", []):
                ownership.own(sandbox_id)
            await self.session.start(attach_to=handoff["sandbox_id"],
                                     fresh_runner=handoff.get("fresh_runner", True) is not False)
            self.session.set_on_shutdown(handoff.get("on_shutdown", "destroy"))
        else:
            await self.session.start(attach_to=self.settings.attach_to, fresh_runner=False,
                                     early=early_start.take())
            self.other_version_line = self.session.other_version_line()
        if self.settings.on_shutdown:
            self.session.set_on_shutdown(self.settings.on_shutdown)
        if self.session.sandbox_id is not None:
            self.kernel.cells.refusals.count_ahead(self.session, self.session.sandbox_id)
        log.info("%s", self.ready_line())

    async def ensure_session(self, out: CellOutput, silent: bool) -> SandboxSession:
        """Wait for the sandbox (a long wait shows progress); retry a failed start once per cell.
        A start that a shutdown gives up (cancels) under the cell is a SessionError saying so."""
        try:
            return await self._wait_for_session(out, silent)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self.task is None or not self.task.cancelled() or (task is not None and task.cancelling()):
                raise  # the cell's own wait was cancelled (an interrupt), not the start
            raise SessionError(self.kernel.shutdown.stopping_line()) from None

    async def _wait_for_session(self, out: CellOutput, silent: bool) -> SandboxSession:
        assert self.task is not None
        if self.failed():
            self.task = asyncio.get_running_loop().create_task(self._start())
        if self.settings is None:
            await self.task  # a configuration error: its line says it all
        if not self.task.done():
            await asyncio.wait([self.task], timeout=SLOW_START)
        if not self.task.done() and not silent:
            line = out.progress(f"Starting a sandbox on {self.provider()}…")
            try:
                await asyncio.shield(self.task)
            except Exception:
                line.update(f"Starting a sandbox on {self.provider()}… failed")  # the next line says why
                raise
            line.update(self.ready_line())
            self.ready_shown = True
        await self.task  # raises the start-up error, if any
        if self.settings and self.settings.show_ready and not self.ready_shown and not silent:
            out.progress(self.ready_line())
            self.ready_shown = True
        if self.other_version_line and not silent:
            out.text(self.other_version_line + "\n", name="stderr")
            self.other_version_line = None
        assert self.session is not None
        return self.session

    def failed(self) -> bool:
        return self.task is not None and self.task.done() and (self.task.cancelled()
                                                               or self.task.exception() is not None)

    def ready(self) -> bool:
        """The sandbox is up and its runner serves."""
        return not (self.task is None or not self.task.done() or self.failed() or self.session is None)

    def starting(self) -> bool:
        return self.task is not None and not self.task.done()

    async def wait_briefly(self) -> None:
        """Wait (at most KERNEL_INFO_WAIT) for the sandbox to be up, if it is starting."""
        if self.task is not None and not self.task.done():
            task = self.task
            await self.kernel.on_main_loop(asyncio.wait([task], timeout=KERNEL_INFO_WAIT))

    async def give_up(self) -> None:
        """At shutdown: a start still under way has BOOT_SHUTDOWN_WAIT to finish, then is cancelled."""
        if self.task is not None and not self.task.done():
            await asyncio.wait([self.task], timeout=BOOT_SHUTDOWN_WAIT)
            self.task.cancel()

    def provider(self) -> str:
        return self.settings.description if self.settings else "an unconfigured provider"

    def ready_line(self) -> str:
        assert self.session is not None
        took = f" in {self.session.boot_seconds:.1f} s" if self.session.boot_seconds else ""
        python = self.session.runner_info.get("python_version", "?")
        why = self.settings.why if self.settings else ""
        return (f"Sandbox {self.session.sandbox_id} ready on {self.provider()}{why}{took} "
                f"(Python {python}) · %sandbox --help")
