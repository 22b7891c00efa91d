"""The kernel process: ipykernel's own app running SandboxKernel (its log lines keep their
"[IPKernelApp]" prefix, which tools such as nbclient expect)."""

from __future__ import annotations

import logging
import sys

from ipykernel.kernelapp import IPKernelApp

from sandbox_kernel.kernel.allocator import reuse_large_buffers
from sandbox_kernel.kernel.handlers import SandboxKernel


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
    app.initialize()
    # traitlets leaves the app's logger at DEBUG and filters in its handlers: every debug line
    # of ipykernel's (several a message, the message formatted whole) was made, then dropped.
    # The logger now lets through only what some handler of it would write.
    app.log.setLevel(min((handler.level or logging.DEBUG for handler in app.log.handlers), default=app.log_level))
    # The kernel's own lines (where its sandbox runs) at the app's level: `--debug` or
    # `--IPKernelApp.log_level=INFO` shows them; by default stderr stays as quiet as ipykernel's.
    logging.getLogger("sandbox_kernel").setLevel(app.log_level)
    app.start()
