"""Interrupts: an interrupt_request (or a SIGINT a frontend sends anyway) cuts short a wait on
the sandbox service (its start, a magic's pause or fork), or else interrupts the cell's code
in the sandbox. The service carries on with what it was asked; only the cell stops waiting."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from sandbox_kernel.kernel.handlers import SandboxKernel

T = TypeVar("T")


class WaitInterrupted(Exception):
    """The user interrupted a wait on the sandbox service (start, pause, fork...)."""


class Interrupts:
    def __init__(self, kernel: SandboxKernel) -> None:
        self.kernel = kernel
        # A wait an interrupt may cut short (the sandbox start, a magic's pause or fork).
        self.interruptible: asyncio.Future[Any] | None = None
        self.wait_interrupted = False

    async def interruptible_wait(self, work: Coroutine[Any, Any, T]) -> T:
        """Await work; an interrupt meanwhile raises WaitInterrupted (work is cancelled).
        Not in a subshell: an interrupt is the main shell's (as under ipykernel)."""
        if self.kernel.subshell_id() is not None:
            return await work
        self.interruptible = task = asyncio.ensure_future(work)
        self.wait_interrupted = False
        try:
            return await task
        except asyncio.CancelledError:
            if self.wait_interrupted and task.cancelled():
                raise WaitInterrupted() from None
            raise  # the kernel itself is being cancelled (shutdown)
        finally:
            self.interruptible = None

    async def interrupt(self) -> None:
        if self.interruptible is not None and not self.interruptible.done():
            self.wait_interrupted = True
            self.interruptible.cancel()
            return
        kernel = self.kernel
        if kernel.boot.starting():
            return  # no cell is waiting for the sandbox that is starting
        if kernel.sandbox and kernel.sandbox.sandbox_id:
            await kernel.sandbox.interrupt()

    def interrupt_soon(self) -> None:
        """From the SIGINT handler, on the shell's loop."""
        asyncio.get_running_loop().create_task(self.interrupt())

    async def request(self, stream, ident, parent):  # type: ignore[no-untyped-def]
        """interrupt_request: its reply goes out whatever happened."""
        content: dict[str, Any] = {"status": "ok"}
        try:
            await self.kernel.on_main_loop(self.interrupt())
        except Exception as exc:  # the reply must go out whatever happened
            content = {"status": "error", "ename": type(exc).__name__, "evalue": str(exc),
                       "traceback": []}
        self.kernel.session.send(stream, "interrupt_reply", content, parent, ident=ident)
