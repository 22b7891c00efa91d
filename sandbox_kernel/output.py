"""What the kernel itself shows in a cell: text, rich displays and updatable progress lines."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

# Marks the kernel's own lines (sandbox status, progress), so tools can tell them apart
# from the user's output.
KERNEL_METADATA = {"sandbox_kernel": {"status": True}}

Send = Callable[[str, dict[str, Any]], None]


class CellOutput:
    """Sends iopub messages for the cell being executed (send = kernel.send_response on iopub)."""

    def __init__(self, send: Send) -> None:
        self.send = send

    def text(self, text: str, name: str = "stdout") -> None:
        self.send("stream", {"name": name, "text": text})

    def display(self, data: dict[str, str], display_id: str | None = None, update: bool = False,
                metadata: dict[str, Any] | None = None) -> None:
        self.send("update_display_data" if update else "display_data",
                  {"data": data, "metadata": metadata or {},
                   "transient": {"display_id": display_id} if display_id else {}})

    def progress(self, text: str) -> ProgressLine:
        return ProgressLine(self, text)


class ProgressLine:
    """One line that updates in place while something long happens (start, pause, resume)."""

    def __init__(self, out: CellOutput, text: str) -> None:
        self.out = out
        self.display_id = uuid.uuid4().hex
        self.headline = text
        self.out.display({"text/plain": text}, self.display_id, metadata=KERNEL_METADATA)

    def __call__(self, detail: str) -> None:
        """Show progress after the headline, e.g. 'pausing… 3 s'."""
        self.update(f"{self.headline} {detail}")

    def update(self, text: str) -> None:
        self.out.display({"text/plain": text}, self.display_id, update=True, metadata=KERNEL_METADATA)
