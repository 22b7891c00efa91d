"""What every family of magics works with: this notebook's session (through its API only),
the cell's output, and the kernel's output filter."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from sandbox_kernel.kernel.output import CellOutput, ProgressLine
from sandbox_kernel.kernel.output_safety import OutputFilter
from sandbox_kernel.sandbox.session import SandboxSession


class MagicFamily:
    """A family of magic commands (lifecycle, egress, files, info). Magics drive the session
    through its methods and never write its fields."""

    def __init__(self, session: SandboxSession, out: CellOutput, output_filter: OutputFilter,
                 payload: list[dict[str, Any]] | None = None) -> None:
        self.session = session
        self.out = out
        self.output_filter = output_filter
        self.payload = payload if payload is not None else []  # the cell's execute_reply payload

    def set_next_input(self, text: str) -> None:
        """Fill the frontend's next input with `text`, as ipykernel's set_next_input does."""
        self.payload[:] = [item for item in self.payload if item.get("source") != "set_next_input"]
        self.payload.append({"source": "set_next_input", "text": text, "replace": False})

    async def transition(self, verb: str, action: Callable[[ProgressLine], Awaitable[object]], outcome: str) -> None:
        """A pause or resume, on one progress line that ends with how long it took."""
        started = time.monotonic()
        line = self.out.progress(f"{verb} sandbox {self.session.sandbox_id}…")
        await action(line)
        line.update(f"Sandbox {self.session.sandbox_id} {outcome} ({time.monotonic() - started:.1f} s)")
