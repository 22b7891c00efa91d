"""Runner events -> IOPub: each event of a cell becomes the matching Jupyter message, on the
parent of the request it answers, within the cell's output cap and through the output
filter; an input_request becomes a question on the stdin channel.

Events come from the sandbox and are untrusted: an event may name an earlier request (its
PARENT: a thread or task of an earlier cell), and only the ids this kernel sent count.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextvars
import logging
from typing import TYPE_CHECKING, Any

from sandbox_kernel.guest import protocol
from sandbox_kernel.sandbox.event_lines import stream_content
from sandbox_kernel.kernel.output import OutputGuard
from sandbox_kernel.kernel.stdin import ask_frontend
from sandbox_kernel.sandbox.session import SandboxSession

if TYPE_CHECKING:
    from sandbox_kernel.kernel.handlers import SandboxKernel

log = logging.getLogger("sandbox_kernel.kernel.events")

# Requests whose output the sandbox can still name (an event's PARENT: a thread or task of
# an earlier cell); older ones are forgotten, and their output is shown as if unnamed.
RECENT_REQUESTS = 256
# Runner events that may answer another request than their cell's (see EventTranslator.handle).
OUTPUT_EVENTS = (protocol.STREAM, protocol.DISPLAY_DATA, protocol.UPDATE_DISPLAY_DATA, protocol.CLEAR_OUTPUT,
                 protocol.EXECUTE_RESULT, protocol.ERROR_EVENT, protocol.COMM)


class EventRouting:
    """Which translator an event goes to: its cell's, a recent request's it names, or (between
    cells) the last cell's."""

    def __init__(self, kernel: SandboxKernel) -> None:
        self.kernel = kernel
        # The last cell's translator: output the runner sends between cells (a background
        # thread's print) is shown on that cell's parent, as ipykernel does.
        self.last_cell: EventTranslator | None = None
        # The translators of recent requests, by msg_id: an event the sandbox tags with an
        # earlier request's id (a thread that chose its cell) is shown on that request.
        self.recent: collections.OrderedDict[str, EventTranslator] = collections.OrderedDict()

    def remember(self, msg_id: str, translator: EventTranslator) -> None:
        self.recent[msg_id] = translator
        self.recent.move_to_end(msg_id)
        while len(self.recent) > RECENT_REQUESTS:
            self.recent.popitem(last=False)

    async def background_event(self, event: dict[str, Any]) -> None:
        """Runner output between cells: on the last cell's parent, within its output cap."""
        if event.get(protocol.TYPE) == protocol.DEBUG_EVENT:
            self.kernel.debugger.publish_event(event.get("content"))
        elif self.last_cell is not None and event.get(protocol.TYPE) != protocol.INPUT_REQUEST:
            await self.last_cell.handle(event)


class EventTranslator:
    """Turns one cell's runner events into iopub messages (and stdin requests)."""

    def __init__(self, kernel: SandboxKernel, session: SandboxSession, cell_id: str) -> None:
        self.kernel = kernel
        self.session = session
        self.cell_id = cell_id
        self.last_error: dict[str, Any] | None = None
        self.asked_exit = False
        self.input_task: asyncio.Task[None] | None = None  # the question the frontend was asked
        self.dropped_input_request = False
        self.guard = OutputGuard(session.settings.output_limit)
        # Its cell's request: events that come after the cell (from a background thread)
        # still belong to it. The events are handled in the channel's reader task, whose
        # context is not the cell's: stdin requests are made in the cell's (ipykernel
        # keeps the parent and its ident in context variables).
        self.parent = kernel.request_parent()
        self.execution_count = kernel.cell_count()
        self.context = contextvars.copy_context()
        msg_id = self.parent.get("header", {}).get("msg_id")
        if msg_id:
            kernel.events.remember(msg_id, self)

    def _send(self, msg_type: str, content: dict[str, Any] | bytes) -> None:
        self.kernel.session.send(self.kernel.iopub_socket, msg_type, content, self.parent)

    async def handle(self, event: dict[str, Any]) -> None:
        kind = event[protocol.TYPE]
        named = event.get(protocol.PARENT)
        if kind in OUTPUT_EVENTS and isinstance(named, str):
            owner = self.kernel.events.recent.get(named)  # the sandbox's word: only ids we sent count
            if owner is not None and owner is not self:
                await owner.handle(event)
                return
        send = self._send
        if not self.guard.admit(event):
            notice = self.guard.notice()
            if notice:
                send("stream", {"name": "stderr", "text": notice})
        elif kind == protocol.STREAM:
            send("stream", stream_content(event))
        elif kind in (protocol.DISPLAY_DATA, protocol.UPDATE_DISPLAY_DATA):
            data, metadata = self.kernel.output_filter.bundle(event["data"], event.get("metadata", {}))
            send(kind, {"data": data, "metadata": metadata, "transient": event.get("transient", {})})
        elif kind == protocol.CLEAR_OUTPUT:
            send("clear_output", {"wait": event.get("wait", False)})
        elif kind == protocol.EXECUTE_RESULT:
            data, metadata = self.kernel.output_filter.bundle(event["data"], event.get("metadata", {}))
            send("execute_result", {"execution_count": self.execution_count, "data": data,
                                    "metadata": metadata})
        elif kind == protocol.ERROR_EVENT:
            self.last_error = {"ename": event["ename"], "evalue": event["evalue"],
                               "traceback": event["traceback"]}
            send("error", self.last_error)
        elif kind == protocol.COMM:
            self._forward_comm(event)
        elif kind == protocol.ASK_EXIT:
            self.asked_exit = True
        elif kind == protocol.INPUT_REQUEST:
            self._input_request(event)

    def _forward_comm(self, event: dict[str, Any]) -> None:
        """A message of a comm in the sandbox, to the frontend, binary buffers restored."""
        content, buffers = event.get("content"), event.get("buffers") or []
        if (event.get("msg_type") not in protocol.COMM_MESSAGES or not isinstance(content, dict)
                or not isinstance(buffers, list)):
            return
        try:
            raw = [base64.b64decode(buffer, validate=True) for buffer in buffers]
        except (TypeError, ValueError):
            log.warning("dropped a comm message with malformed buffers")
            return
        metadata = event.get("metadata") if isinstance(event.get("metadata"), dict) else {}
        allowed = self.kernel.output_filter.comm_from_sandbox(event["msg_type"], content, raw)
        if allowed is None:
            return
        content, raw = allowed
        # On its cell's parent, like the cell's other output (this runs in the channel's reader
        # task, whose context holds no parent): the frontend's Output widgets capture by it.
        self.kernel.session.send(self.kernel.iopub_socket, event["msg_type"], content, self.parent,
                                 buffers=raw, metadata=metadata)

    def _input_request(self, event: dict[str, Any]) -> None:
        """Ask the frontend, without blocking the event stream while the user types. One
        question of a cell at a time: the runner asks one and waits for its answer, so a
        second one meanwhile is forged by code in the sandbox, and is dropped (one log line
        a cell), costing no more than this check."""
        if self.input_task is not None and not self.input_task.done():
            if not self.dropped_input_request:
                self.dropped_input_request = True
                log.warning("cell %s: dropped an input_request while one was waiting for its answer", self.cell_id)
            return
        prompt, password = event.get("prompt", ""), event.get("password", False)
        self.input_task = self.context.run(
            asyncio.get_running_loop().create_task,
            self._ask(prompt if isinstance(prompt, str) else "", password if isinstance(password, bool) else False))

    async def _ask(self, prompt: str, password: bool) -> None:
        await self.session.send_input(self.cell_id, await ask_frontend(self.kernel, prompt, password))

    def flush_input_tasks(self) -> None:
        if self.input_task is not None:
            self.input_task.cancel()
