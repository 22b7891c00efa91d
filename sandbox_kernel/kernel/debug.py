"""The debugger: debugpy in the sandbox (guest/runner/debug.py). The frontend's DAP requests
go to it through the runner, its answers come back as debug_reply, its events as
debug_event on IOPub, within a budget."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from sandbox_kernel.guest import protocol

if TYPE_CHECKING:
    from sandbox_kernel.kernel.handlers import SandboxKernel

log = logging.getLogger("sandbox_kernel.kernel.debug")

# Bytes of debug events the sandbox may send between two debug requests of the frontend
# (an honest debugger sends a few small events per step); the rest are dropped.
DEBUG_EVENT_BUDGET = 4 * 1024 * 1024


class DebugRelay:
    """Between the frontend's debugger panel and the debugger in the sandbox."""

    def __init__(self, kernel: SandboxKernel) -> None:
        self.kernel = kernel
        self.event_budget = DEBUG_EVENT_BUDGET

    def available(self) -> bool:
        """The sandbox's Python has debugpy and IPython, and a channel carries its events
        (the exec-per-cell fallback has none)."""
        return self.kernel.runner_offers("debugger")

    async def request(self, msg: dict[str, Any]) -> dict[str, Any]:
        """A DAP request, answered by the debugger in the sandbox; unsuccessful where there is none."""
        kernel = self.kernel
        await kernel.boot.wait_briefly()
        if not self.available():
            return refusal(msg, "sandbox-kernel has no debugger for this sandbox: its Python needs "
                           "IPython and debugpy (`%pip install debugpy`, then restart the kernel)")
        assert kernel.sandbox is not None
        self.event_budget = DEBUG_EVENT_BUDGET  # the frontend is listening
        try:
            answer = await kernel.on_main_loop(
                kernel.sandbox.runner_request({protocol.OP: protocol.DEBUG, "request": msg}))
        except Exception as exc:  # a runner that died or stopped answering: the reply says so
            return refusal(msg, f"the debugger in the sandbox did not answer: {exc}")
        response = answer.get("response")
        if not isinstance(response, dict):
            return refusal(msg, "the debugger in the sandbox gave no response")
        return kernel.output_filter.debug_response(response)

    def publish_event(self, content: object) -> None:
        """A DAP event of the sandbox's debugger, on IOPub, within DEBUG_EVENT_BUDGET."""
        if not isinstance(content, dict) or content.get("type") != "event":
            return
        size = len(json.dumps(content))
        if size > self.event_budget:
            log.warning("dropped a debug event of %d bytes: over the budget between debug requests", size)
            return
        self.event_budget -= size
        kernel = self.kernel
        kernel.session.send(kernel.iopub_socket, "debug_event", content, kernel.get_parent("control"))


def refusal(request: dict[str, Any], message: str) -> dict[str, Any]:
    """An unsuccessful DAP response to `request`, saying why."""
    return {"type": "response", "seq": 0, "request_seq": request.get("seq", 0), "success": False,
            "command": request.get("command", ""), "message": message}
