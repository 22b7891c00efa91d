"""input() in the sandbox: the question goes to the frontend on the stdin channel, and the
answer is polled for without blocking the shell's loop."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import zmq

if TYPE_CHECKING:
    from sandbox_kernel.kernel.handlers import SandboxKernel

log = logging.getLogger("sandbox_kernel.kernel.stdin")

STDIN_POLL = 0.01  # seconds between looks for the frontend's input_reply


async def ask_frontend(kernel: SandboxKernel, prompt: str, password: bool) -> str | None:
    """An input_request on the stdin channel; the answer, or None if the frontend cannot
    give one (no stdin, EOF). Awaited on the shell's loop, never in a thread: a question
    the user interrupted is cancelled here, so no thread is left on the stdin socket
    (zmq sockets are not thread-safe, and such a thread would hold up shutdown)."""
    if not kernel.request_parent().get("content", {}).get("allow_stdin", False):
        return None
    session, socket = kernel.session, kernel.stdin_socket
    while session.recv(socket, mode=zmq.NOBLOCK)[1] is not None:
        pass  # the answer to an earlier question, interrupted
    ident = kernel._get_shell_context_var(kernel._shell_parent_ident)
    session.send(socket, "input_request", {"prompt": prompt, "password": password},
                 kernel.get_parent("shell"), ident=ident)
    while True:
        try:
            _, reply = session.recv(socket, mode=zmq.NOBLOCK)
        except Exception as exc:  # a malformed message: wait for a good one
            log.warning("invalid input_reply: %s", exc)
            reply = None
        if reply is not None:
            value = reply.get("content", {}).get("value", "")
            return None if value == "\x04" else str(value)  # ^D: end of input
        await asyncio.sleep(STDIN_POLL)
