"""The kernel process: ipykernel's own app running SandboxKernel (its log lines keep their
"[IPKernelApp]" prefix, which tools such as nbclient expect)."""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any

import zmq
from ipykernel.kernelapp import IPKernelApp

from sandbox_kernel.kernel import early_listen
from sandbox_kernel.kernel.allocator import reuse_large_buffers
from sandbox_kernel.kernel.handlers import SandboxKernel

# At exit, how long the control thread has to finish the message it handles (its last status).
CONTROL_THREAD_WAIT = 2.0


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    reuse_large_buffers()
    # No OutStream for the kernel process: the notebook's output comes from the sandbox, and
    # what this process writes (a library's warning) belongs in its log, not in a cell. ipykernel
    # flushes sys.stdout and sys.stderr four times a cell, each an OutStream's round trip to the
    # IOPub thread while the shell waits: ~2 ms of a trivial cell's 16 measured side by side.
    # At exit the control thread's flush after its shutdown_reply waited for IOPub, which
    # ipykernel had stopped already, and the kernel lingered 10 s (killed by jupyter_client).
    app = IPKernelApp.instance(kernel_class=SandboxKernel, outstream_class=None)
    _bind_onto_early_listeners(app)
    app.initialize()
    early_listen.close_unused()
    # traitlets leaves the app's logger at DEBUG and filters in its handlers: every debug line
    # of ipykernel's (several a message, the message formatted whole) was made, then dropped.
    # The logger now lets through only what some handler of it would write.
    app.log.setLevel(min((handler.level or logging.DEBUG for handler in app.log.handlers), default=app.log_level))
    # The kernel's own lines (where its sandbox runs) at the app's level: `--debug` or
    # `--IPKernelApp.log_level=INFO` shows them; by default stderr stays as quiet as ipykernel's.
    logging.getLogger("sandbox_kernel").setLevel(app.log_level)
    app.start()
    _let_the_control_thread_finish(app)


def _bind_onto_early_listeners(app: IPKernelApp) -> None:
    """ipykernel's zmq sockets bound onto the ports kernel/__main__ listens on already
    (early_listen.py), so the connections and requests waiting there are theirs. The app's
    own method is wrapped on this instance rather than in a subclass: the subclass's name
    would become the prefix of the app's log lines, and tools such as nbclient expect
    "[IPKernelApp]"."""
    bind = app._bind_socket

    def bind_socket(socket: zmq.Socket[Any], port: int) -> int:
        # libzmq takes a descriptor given this way as its listener whatever the endpoint's
        # address says: no bind of its own is tried, so none can fail in its place.
        fd = early_listen.take(app.ip, port) if app.transport == "tcp" else None
        if fd is not None:
            socket.setsockopt(zmq.USE_FD, fd)
        return bind(socket, port)

    app._bind_socket = bind_socket  # type: ignore[method-assign]


def _let_the_control_thread_finish(app: IPKernelApp) -> None:
    """The kernel's loops have stopped (a shutdown_request, or the runner's death). ipykernel's
    close, at exit, closes IOPub first and stops the control thread after, while that thread
    may still be publishing the idle status that ends its shutdown_request: a send on a socket
    closed under it, a ZMQError, or inside libzmq an abort (signaler.cpp's assertion: the
    kernel ended with status -6). So the control thread ends first."""
    control = app.control_thread
    if control is None or not control.is_alive():
        return
    with contextlib.suppress(RuntimeError):  # its loop closed meanwhile: it is ending anyway
        control.stop()
    control.join(CONTROL_THREAD_WAIT)
