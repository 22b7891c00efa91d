"""Comms (ipywidgets...): the comm manager lives in the sandbox. A frontend's comm messages
are delivered there in the order they came, each run like a silent cell so that its
handlers' messages come back with it as parent; comm_info is answered by the sandbox. The
kernel's own comms (its progress bars, progress_widget.py) are host state: the frontend's
messages on them stay here, and the sandbox never learns their ids."""

from __future__ import annotations

import asyncio
import base64
import contextvars
import logging
import uuid
from typing import TYPE_CHECKING, Any

from sandbox_kernel.guest import protocol
from sandbox_kernel.kernel.events import EventTranslator
from sandbox_kernel.kernel.request_context import REQUEST_PARENT

if TYPE_CHECKING:
    from sandbox_kernel.kernel.handlers import SandboxKernel

log = logging.getLogger("sandbox_kernel.kernel.comms")

# Whether ipykernel dispatches the shell message being handled "concurrently": a comm message
# that came while another shell message was being handled, which it announces with no status
# (SandboxKernel.dispatch_shell sets it).
DISPATCHED_CONCURRENTLY: contextvars.ContextVar[bool] = contextvars.ContextVar("dispatched_concurrently",
                                                                               default=False)


class CommRelay:
    """The frontend's comm messages to the sandbox, one at a time and in order."""

    def __init__(self, kernel: SandboxKernel) -> None:
        self.kernel = kernel
        # ipykernel dispatches comm messages concurrently while a shell message is handled;
        # they must reach the sandbox in the order they came (a comm_msg after its comm_open).
        # Taken on the shell's loop only (see from_frontend).
        self.order = asyncio.Lock()

    async def from_frontend(self, stream, ident, parent):  # type: ignore[no-untyped-def]
        """comm_open/comm_msg/comm_close: run in the sandbox like a silent cell, so the
        handlers' messages (a widget's echo, its output) come back with this one as parent.

        ipykernel hands over a comm message that comes while another shell message is handled
        at once, without the busy and idle statuses of its parent; here handlers take a round
        trip to the sandbox, so in a burst of widget changes most messages come that way. But
        ipywidgets' frontend sends a widget's next change only once the previous message is
        idle: without the statuses the last changes of a burst were never sent. So each gets
        them, in turn, as ipykernel's own comm messages do, unless a cell is running (the
        kernel is busy with it: a cell may await a widget's answer).

        JupyterLab sends a comm target's messages on a subshell of their own once the kernel
        has subshells (and on the main shell until it is made), so they may be handled on a
        subshell's thread: they are delivered from the shell's loop, in one order with the
        main shell's. From the subshell's loop, the channel's answer (a future the shell's
        loop completes) did not wake it, and the message hung until another came; and the
        order lock, taken from two loops, refused one ("bound to a different event loop")."""
        announce = DISPATCHED_CONCURRENTLY.get() and not self.kernel.cells_executing
        # Its own parent: one that comes during a cell is handled in the cell's context (the
        # shell's loop runs the delivery in a copy of this context, with this parent).
        request = REQUEST_PARENT.set(parent)
        try:
            await self.kernel.on_main_loop(self._deliver(parent, announce))
        finally:
            REQUEST_PARENT.reset(request)

    async def _deliver(self, parent: dict[str, Any], announce: bool) -> None:
        kernel = self.kernel
        # Noted even before the sandbox is up: JupyterLab's widget manager opens its control
        # comm as soon as it meets the kernel, and only then (output_safety.frontend_has_widgets).
        kernel.output_filter.comm_from_frontend(parent["header"]["msg_type"], parent["content"])
        if kernel.output_filter.is_host_comm(parent["content"].get("comm_id")):
            # A view of the kernel's own bar: the bar is output only, and the sandbox must not
            # learn its id.
            log.debug("%s on the kernel's own comm: kept on the host", parent["header"]["msg_type"])
            return
        if not kernel.boot.ready():
            log.warning("%s before the sandbox is up: dropped", parent["header"]["msg_type"])
            return
        assert kernel.sandbox is not None
        message = {"msg_type": parent["header"]["msg_type"], "content": parent["content"],
                   "metadata": parent.get("metadata") or {},
                   "buffers": [base64.b64encode(bytes(buffer)).decode("ascii") for buffer in parent.get("buffers") or []]}
        cell_id = uuid.uuid4().hex
        translate = EventTranslator(kernel, kernel.sandbox, cell_id)
        try:
            async with self.order:
                if announce:
                    kernel._publish_status("busy", "shell", parent)
                try:
                    await kernel.sandbox.run_cell(cell_id, "", translate.handle, silent=True, store_history=False,
                                                  fields={"comm": message, "parent_msg_id": kernel.parent_msg_id()})
                finally:
                    if announce:
                        kernel._publish_status("idle", "shell", parent)
        except Exception as exc:  # no reply to send: the frontend learns nothing, the log does
            log.warning("%s not delivered: %s", message["msg_type"], exc)
        finally:
            translate.flush_input_tasks()

    async def info_request(self, stream, ident, parent):  # type: ignore[no-untyped-def]
        """comm_info_request: the comms open in the sandbox (none while it is not up)."""
        target_name = parent["content"].get("target_name")
        answer = await self.kernel.queries.ask_runner({protocol.OP: protocol.COMM_INFO, "target_name": target_name})
        comms = answer.get("comms") if isinstance(answer.get("comms"), dict) else {}
        comms = {str(comm_id): {"target_name": str(info.get("target_name", ""))}
                 for comm_id, info in comms.items() if isinstance(info, dict)}
        self.kernel.session.send(stream, "comm_info_reply", {"status": "ok", "comms": comms}, parent, ident=ident)
