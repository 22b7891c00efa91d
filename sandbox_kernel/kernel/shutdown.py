"""The kernel's end: a shutdown applies the notebook's policy to its sandboxes and says what
outlives it; a restart hands the sandbox to the next kernel process (handoff.py); a runner
that died ends this process as a kernel whose Python dies ends. Cells being handled meanwhile
still get their replies."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Never

from sandbox_kernel.sandbox.errors import RunnerDied

if TYPE_CHECKING:
    from sandbox_kernel.kernel.handlers import SandboxKernel

log = logging.getLogger("sandbox_kernel.kernel.shutdown")

# At shutdown, how long the cells being handled have to send their replies (each is told at
# once that the kernel is going: this only lets the reply leave before the loop stops).
REPLY_SHUTDOWN_WAIT = 2.0
REPLY_POLL = 0.01  # seconds between looks at the count of cells not answered yet


class Shutdown:
    def __init__(self, kernel: SandboxKernel) -> None:
        self.kernel = kernel
        # Set when a shutdown or restart begins ("shutting down", "restarting"): a cell that
        # comes then is answered at once, with one line, rather than run in a closing sandbox.
        self.stopping: str | None = None
        # execute_requests handled and not answered yet, on any thread (see _replies_sent).
        self.unanswered = 0
        self.unanswered_lock = threading.Lock()
        self.dying = False  # the runner died: this process is ending (die_with_the_runner)

    def stopping_line(self) -> str:
        return f"the kernel is {self.stopping or 'shutting down'}: the cell did not run"

    @contextmanager
    def counted(self) -> Iterator[None]:
        """An execute_request being handled, counted until it is answered."""
        with self.unanswered_lock:
            self.unanswered += 1
        try:
            yield
        finally:
            with self.unanswered_lock:
                self.unanswered -= 1

    async def do_shutdown(self, restart: bool) -> dict[str, Any]:
        kernel = self.kernel
        self.stopping = "restarting" if restart else "shutting down"
        if kernel.sandbox is not None:
            try:
                # The request arrives on the control thread; the API client lives on the shell's loop.
                if restart:
                    # jupyter_client restarts by starting a new kernel process: hand it our
                    # sandboxes, so a restart is a fresh runner in the same sandbox.
                    await kernel.on_main_loop(kernel.handoff.hand_off(kernel.sandbox))
                else:
                    # Needed once, here: not imported at the kernel's start.
                    from sandbox_kernel.sandbox.shutdown_policy import farewell

                    await kernel.on_main_loop(kernel.boot.give_up())
                    self._last_words(farewell(await kernel.on_main_loop(kernel.sandbox.shutdown())))
            except Exception as exc:
                log.warning("shutdown: %s", exc)
        await self._replies_sent()
        return {"status": "ok", "restart": restart}

    async def _replies_sent(self) -> None:
        """Every execute_request gets its reply: the cells being handled (told that the kernel
        is going, or ended with their sandbox's channel) are given a moment to send theirs
        before ipykernel stops the loops."""
        deadline = time.monotonic() + REPLY_SHUTDOWN_WAIT
        while self.unanswered and time.monotonic() < deadline:
            await asyncio.sleep(REPLY_POLL)

    def _last_words(self, text: str) -> None:
        """What outlives the notebook, on the frontend (if it still listens) and in the log."""
        if text:
            log.warning("%s", text.strip())
            self.kernel.send_response(self.kernel.iopub_socket, "stream", {"name": "stderr", "text": text},
                                      channel="control")

    async def runner_died_between_cells(self, died: RunnerDied) -> None:
        """The channel learnt that the Python died while no cell ran (a background thread's
        os._exit, the OOM killer): the kernel ends at once, its line on the last cell's
        parent (where that Python's background output goes), as for a death in a cell."""
        if self.stopping is None:  # else a shutdown or restart is under way: its end is ours
            last_cell = self.kernel.events.last_cell
            await self.die_with_the_runner(str(died), parent=last_cell.parent if last_cell else {})

    async def die_with_the_runner(self, why: str, parent: dict[str, Any] | None = None) -> Never:
        """The notebook's Python died: end this kernel process as a kernel whose Python dies
        ends, so that every frontend knows the state is gone (JupyterLab restarts the kernel,
        nbclient raises DeadKernelError). The cell (or `parent`) says why; a cell gets no
        reply, as under ipykernel. The sandbox is handed to the restarted kernel (the restart
        hand-off), which starts a Python in it: the files are kept; with no restart the
        shutdown policy holds (session.close_for_restart). Called again (a cell and the
        channel both learnt the death), it only waits for the end."""
        kernel = self.kernel
        if not self.dying:
            self.dying = True
            log.warning("%s", why)
            kernel.session.send(kernel.iopub_socket, "stream", {"name": "stderr", "text": f"sandbox-kernel: {why}\n"},
                                kernel.request_parent() if parent is None else parent)
            self.stopping = "restarting"
            assert kernel.sandbox is not None
            await kernel.handoff.hand_off(kernel.sandbox, fresh_runner=False)
            self._end_process()
        await asyncio.Event().wait()  # this cell ends with the process
        raise AssertionError("unreachable")

    def _end_process(self) -> None:
        # As ipykernel's shutdown_request ends the process: its loops stop, then atexit sends
        # what IOPub still holds (the line above).
        kernel = self.kernel
        for stream in (kernel.control_stream, kernel.shell_stream):
            if stream is not None:
                stream.io_loop.add_callback(stream.io_loop.stop)
        kernel.io_loop.add_callback(kernel.io_loop.stop)
