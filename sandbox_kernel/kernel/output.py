"""What the kernel itself shows in a cell: text, rich displays and updatable progress lines."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Protocol

from sandbox_kernel.guest import protocol

# Marks the kernel's own lines (sandbox status, progress), so tools can tell them apart
# from the user's output.
KERNEL_METADATA = {"sandbox_kernel": {"status": True}}


class Send(Protocol):
    """kernel.send_iopub: one iopub message on the request being handled."""

    def __call__(self, msg_type: str, content: dict[str, Any], metadata: dict[str, Any] | None = None) -> None: ...


def html_without_math(body: str) -> str:
    """HTML the kernel emits, marked so that JupyterLab does not typeset `$…$` in it as LaTeX
    (its MathJax skips these classes, as for pandas tables). Escaping `$` as `&#36;` would
    not do: the typesetter reads the decoded text."""
    return f'<div class="tex2jax_ignore mathjax_ignore">{body}</div>'


# A waiting progress line's tick, e.g. "(pausing, 3 s)" (SandboxSession.pause): worth showing only
# where the line updates in place.
TICK = re.compile(r"\(\w+, \d+ s\)")


class CellOutput:
    """Sends iopub messages for the cell being executed (send = kernel.send_response on iopub).

    in_place: whether the frontend updates a display in place (notebooks do; `jupyter console`
    ignores update_display_data, so there a progress line's outcome is shown as a new line)."""

    def __init__(self, send: Send, in_place: bool = True) -> None:
        self.send = send
        self.in_place = in_place

    def text(self, text: str, name: str = "stdout") -> None:
        self.send("stream", {"name": name, "text": text})

    def display(self, data: dict[str, str], display_id: str | None = None, update: bool = False,
                metadata: dict[str, Any] | None = None) -> None:
        self.send("update_display_data" if update else "display_data",
                  {"data": data, "metadata": metadata or {},
                   "transient": {"display_id": display_id} if display_id else {}})

    def comm(self, msg_type: str, content: dict[str, Any], metadata: dict[str, Any] | None = None) -> None:
        """A message of a comm the kernel itself opened (progress_widget.py)."""
        self.send(msg_type, content, metadata)

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
        """Show progress after the headline, e.g. '(pausing, 3 s)' or 'resumed in 0.1 s'. A
        terminal prints each update as a line of its own, under the headline: there the
        detail alone (the headline again would say "resuming…" twice)."""
        if self.out.in_place:
            self.update(f"{self.headline} {detail}")
        elif not TICK.fullmatch(detail):
            self.update(detail)

    def update(self, text: str) -> None:
        self.out.display({"text/plain": text}, self.display_id, update=self.out.in_place,
                         metadata=KERNEL_METADATA)


class OutputGuard:
    """The kernel's own cap on what one cell shows, behind the runner's.

    The runner caps each cell's output inside the sandbox (runner.OutputBudget), but it
    is code in the sandbox, which a cell could get around. So the kernel counts too and
    drops what goes past the limit, saying so once. Every event kind counts (a forged
    runner could send endless results or errors), but no more than the runner counts
    for its own kinds (only the displays' values), with room for the runner's notice and
    the few events it does not count, so an honest runner never meets this cap.
    """

    SLACK = 64 * 1024

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.noticed = False

    def admit(self, event: dict[str, Any]) -> bool:
        """Whether to show this runner event (none past the limit)."""
        kind = event.get(protocol.TYPE)
        if kind == protocol.STREAM:
            self.used += len(event.get("text", ""))
        elif isinstance(event.get("data"), dict):  # displays and results
            self.used += sum(len(value) if isinstance(value, str) else len(json.dumps(value))
                             for value in event["data"].values())
        else:  # errors, input requests, clear_output...: small, unless forged
            self.used += len(json.dumps(event))
        return self.used <= self.limit + self.SLACK

    def notice(self) -> str | None:
        """The line to show after the first refusal (None after that)."""
        if self.noticed:
            return None
        self.noticed = True
        return (f"[sandbox-kernel] output limit reached: {round(self.limit / 2**20, 2):g} MiB shown, "
                "further output of this cell discarded\n")
