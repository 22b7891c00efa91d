"""Which request the kernel is handling, where a thread or loop cannot tell by itself.

An execute_request may come on the control channel too, and a subshell's on a thread of its
own; its cell then runs on the shell's loop (where the sandbox session lives), so the cell's
outputs must not take the shell's parent from there. These context variables travel with
the request's work to whichever loop runs it.
"""

from __future__ import annotations

import contextvars
from typing import Any

# The request whose cell is running (SandboxKernel.request_parent reads it).
REQUEST_PARENT: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("request_parent")
# The execution count of the cell being handled: the one its execute_input showed (cells of
# subshells run meanwhile and take the next numbers).
CELL_COUNT: contextvars.ContextVar[int] = contextvars.ContextVar("cell_count")
