"""A cell sent to the sandbox as its execute_request arrives, ahead of ipykernel's dispatch.

Plain ipykernel starts a cell once its dispatch (deserializing the request, the busy status,
execute_input, do_execute) is done. Here the cell's way into the sandbox (its request to the
engine, the engine's and the runner's wake-ups) came after that dispatch too. Sent as the
request arrives, that way overlaps the dispatch instead (docs/performance.md has the numbers).

A cell goes ahead only where going ahead changes nothing else:
- it is the main shell's, and no subshell exists (a subshell's cell, on a thread of its own,
  could take the next execution count between this one's prediction and its dispatch);
- no other main-shell message is being handled or waiting (SandboxKernel.shell_main counts
  them), so it is the next thing this shell says to the sandbox, as it would have been;
- the sandbox is up with a channel to its runner (the exec-per-cell fallback has no moment
  at which the runner is known to have the cell: see below), nothing is aborting (ipykernel
  would abort the request), the kernel is not stopping;
- it is code alone: no magic line, no user_expressions, not silent, not `exit`, and the
  sandbox's egress refusals already counted. cells.execute's first act is then this very run,
  with the same request.

Its events are held until do_execute takes the cell over (EarlyCells.take), after
execute_input: the frontend sees what it would have seen, in the same order. Events come only
when the kernel's loop turns. Between the request's arrival and its do_execute the loop turns
while the dispatch waits for the local engine (below), which a first event of the cell ends,
and once or twice after, waiting for nothing outside: what is held is what the channel's
reader took in those turns. A sandbox that refuses the cell (paused) has not run it:
do_execute's own run wakes the sandbox and runs it, as for any cell. A cell that went ahead
has started, so a shutdown that begins meanwhile does not turn it away (cells.execute).

On the local engine the dispatch waits (at most DISPATCH_WAIT) until the engine has handed the
cell to the runner: the engine runs on this machine's CPUs, and ipykernel's dispatch (on this
thread and its IOPub thread's) took them from it when both ran at once. The runner's part that
follows is longer than the whole dispatch, which is then done long before the first output.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import uuid
from typing import TYPE_CHECKING, Any

from sandbox_kernel.api import ConflictError
from sandbox_kernel.kernel.magics.parsing import split_cell
from sandbox_kernel.sandbox.channel import EventHandler

if TYPE_CHECKING:
    from sandbox_kernel.kernel.handlers import SandboxKernel

log = logging.getLogger("sandbox_kernel.kernel.early_cell")

# How long ipykernel's dispatch of a request waits for the local engine to hand its cell, sent
# ahead, to the runner (about 1 ms; more only when the engine is busy, and then the dispatch
# goes on without waiting longer).
DISPATCH_WAIT = 0.05


class EarlyCell:
    """One cell on its way to the sandbox before its do_execute: its run, and its events held."""

    def __init__(self, frames: list[Any], msg_id: str, code: str, execution_count: int,
                 store_history: bool, allow_stdin: bool) -> None:
        self.frames = frames  # the request as it came (SandboxKernel.dispatch_shell gets the same)
        self.msg_id = msg_id
        self.code = code
        self.execution_count = execution_count
        self.store_history = store_history
        self.allow_stdin = allow_stdin
        self.cell_id = uuid.uuid4().hex
        self.run: asyncio.Task[dict[str, Any]] | None = None
        self._held: collections.deque[dict[str, Any]] | None = collections.deque()  # None once taken over or dropped
        self._handler: EventHandler | None = None
        # Set once the sandbox has the cell (the engine answered its input call, or an event of
        # the cell came) or its run ended.
        self.delivered = asyncio.Event()

    async def on_event(self, event: dict[str, Any]) -> None:
        if self._held is not None:
            self._held.append(event)
            self.delivered.set()  # an event of the cell: the runner has it
        elif self._handler is not None:
            await self._handler(event)

    async def result(self, handler: EventHandler) -> dict[str, Any] | None:
        """The cell's done event, its events now going to handler (those held first, in order);
        None if the sandbox refused the cell (not running): it was not run."""
        assert self.run is not None and self._held is not None
        held = self._held
        while held:  # events that come while the held ones are handled join the queue
            await handler(held.popleft())
        self._held, self._handler = None, handler
        try:
            return await self.run
        except ConflictError as exc:
            log.debug("request %s: the sandbox refused its cell sent ahead (%s); the cell's own run wakes it",
                      self.msg_id, exc)
            return None

    def drop(self) -> None:
        """Not taken over: its request's dispatch ended before its do_execute took it (an error
        on the way). Its events go."""
        self._held = None
        if self.run is not None and not self.run.cancel() and not self.run.cancelled():
            self.run.exception()  # it had ended: its outcome is read (asyncio reports one never read)


class EarlyCells:
    """The one cell sent ahead, until its do_execute takes it over."""

    def __init__(self, kernel: SandboxKernel) -> None:
        self.kernel = kernel
        self.pending: EarlyCell | None = None

    def send(self, frames: list[Any]) -> EarlyCell | None:
        """At a shell message's arrival, with no other shell message being handled: if it is
        an execute_request whose first act would be running its code, start that run now."""
        session = self.kernel.sandbox
        early = self._cell_to_send(frames) if self.pending is None else None
        if early is None or session is None:
            return None
        # The same request as cells.execute's (fields as it makes them for such a cell).
        fields = {"allow_stdin": early.allow_stdin, "parent_msg_id": early.msg_id}
        early.run = asyncio.get_running_loop().create_task(session.run_cell(
            early.cell_id, early.code, early.on_event, silent=False, store_history=early.store_history,
            execution_count=early.execution_count, fields=fields, wake=False, on_sent=early.delivered.set))
        early.run.add_done_callback(lambda _: early.delivered.set())
        self.pending = early
        log.debug("request %s: its cell was sent ahead of its dispatch", early.msg_id)
        return early

    async def before_dispatch(self, frames: list[Any]) -> None:
        """Before ipykernel dispatches request `frames`: if its cell went ahead to the local
        engine, until the engine has handed it to the runner (at most DISPATCH_WAIT)."""
        early = self.pending
        settings = self.kernel.settings
        if early is None or early.frames is not frames or settings is None or settings.provider != "local":
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(early.delivered.wait(), DISPATCH_WAIT)

    def went_ahead(self, msg_id: str) -> bool:
        return self.pending is not None and self.pending.msg_id == msg_id

    def take(self, msg_id: str, code: str) -> EarlyCell | None:
        """The cell sent ahead for request msg_id, if that is it (and code its code)."""
        early = self.pending
        if early is None or early.msg_id != msg_id or early.code != code:
            return None
        self.pending = None
        if early.execution_count != self.kernel.cell_count():
            log.warning("cell %s was sent as In[%d] but announced as In[%d]", early.cell_id,
                        early.execution_count, self.kernel.cell_count())
        return early

    def forget(self, early: EarlyCell) -> None:
        """After its request's dispatch: if it was not taken over, it is dropped."""
        if self.pending is early:
            self.pending = None
            log.warning("request %s ended without taking over its cell sent ahead (%s): its output is not shown",
                        early.msg_id, early.cell_id)
            early.drop()

    def _cell_to_send(self, frames: list[Any]) -> EarlyCell | None:
        kernel = self.kernel
        session = kernel.sandbox
        if (kernel.shutdown.stopping or not kernel.boot.ready() or session is None or not session.has_channel
                or kernel._aborting or kernel.subshells.exist()):
            return None
        try:
            _, message = kernel.session.feed_identities(frames, copy=False)
            # Checks the signature without recording it: dispatch_shell's own deserialize does.
            msg = kernel.session.deserialize(message, content=False, copy=False)
            header = msg["header"]
            if header.get("msg_type") != "execute_request" or header.get("subshell_id") is not None:
                return None
            content = kernel.session.unpack(msg["content"])
        except Exception:  # dispatch_shell says what is wrong with the message
            return None
        code, store_history, allow_stdin = (content.get("code"), content.get("store_history", True),
                                            content.get("allow_stdin", False))
        if (not isinstance(code, str) or content.get("silent", False) is not False or content.get("user_expressions")
                or not isinstance(store_history, bool) or not isinstance(allow_stdin, bool)):
            return None
        segments = split_cell(code)
        if (len(segments) != 1 or segments[0].magic or kernel.cells.exit_cell(code)
                or not kernel.cells.refusals.counted(session.sandbox_id)):
            return None
        # execute_request counts the cell (not silent) before its do_execute.
        return EarlyCell(frames, str(header.get("msg_id", "")), segments[0].text, kernel.execution_count + 1,
                         store_history, allow_stdin)
