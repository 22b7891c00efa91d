"""The event loops cells run on: the main shell's queue of cells, a kernel subshell's thread
with its own loop, and the awaiting cell task an interrupt cancels.

Imported once the daemon has said it is ready: asyncio (with what it imports) is the largest
of the daemon's imports, and only the loops need it.
"""
from __future__ import annotations

import asyncio
import os
import queue
import threading
import typing

from .cells import Cell


class CellTask:
    """The asyncio task of the main shell's cell running now, while it awaits (top-level
    await), so that an interrupt can cancel it (Daemon._on_interrupt). A subshell's cell
    (in another thread) is not interrupted, as under ipykernel, where SIGINT reaches only
    the main thread."""

    current: "asyncio.Future | None" = None

    @classmethod
    async def run(cls, coroutine) -> object:
        task = asyncio.ensure_future(coroutine)
        if threading.current_thread() is not threading.main_thread():
            return await task
        cls.current = task
        try:
            return await task
        finally:
            cls.current = None


class CellQueue:
    """Submitted cells, run one at a time, in order, on the event loop of one thread."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Cell | None] = queue.Queue()
        self._wake: "typing.Callable[[], None] | None" = None  # set once serve() runs

    def put(self, cell: "Cell | None") -> None:
        """Queue a cell (from any thread); None ends serve() once the cells before it ran."""
        self._queue.put(cell)
        wake = self._wake
        if wake is not None:
            wake()

    async def serve(self, execute: "typing.Callable[[Cell], typing.Awaitable[None]]") -> None:
        loop = asyncio.get_running_loop()
        queued = asyncio.Event()
        self._wake = lambda: loop.call_soon_threadsafe(queued.set)
        while True:
            try:
                cell = self._queue.get_nowait()
            except queue.Empty:
                await queued.wait()
                queued.clear()
                continue
            if cell is None:
                return
            await execute(cell)
            await asyncio.sleep(0)  # tasks the cell started take a step before the next cell


class Subshell:
    """A kernel subshell (ipykernel 7): its own thread, where its cells run one at a time
    on its own event loop, concurrently with the main thread's and other subshells'. The
    IPython shell and the user's namespace are shared, as under ipykernel."""

    def __init__(self, subshell_id: str, execute: "typing.Callable[[Cell], typing.Awaitable[None]]") -> None:
        self.subshell_id = subshell_id
        self.cells = CellQueue()
        self._execute = execute
        self.thread = threading.Thread(target=self._serve, name="subshell-" + subshell_id, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self.cells.serve(self._execute))
        finally:
            loop.close()

    def end(self) -> None:
        """After its queued cells (the kernel sends none once it deletes the subshell)."""
        self.cells.put(None)
        self.thread.join()


def event_loop_files() -> tuple:
    """Where the event loop's own code lives (asyncio, selectors): a signal that arrives
    there found the main thread idle in the loop."""
    import selectors

    return (os.path.dirname(asyncio.__file__) + os.sep, selectors.__file__)

