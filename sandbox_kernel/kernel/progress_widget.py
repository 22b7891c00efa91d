"""Progress the kernel itself shows as "k of n done" (a sweep's branches): a widget bar where
the frontend shows widgets, a text line that updates in place elsewhere.

The bar is ipywidgets' own IntProgress and a Label with the text line, in an HBox, made by the kernel speaking
ipywidgets' comm protocol as its Python side would: one comm_open per model on the
`jupyter.widget` target (its state, protocol version in the metadata), a display of the box's
view, "update" messages, comm_close. Its models are host state, not the sandbox's: their comm
ids come from the output filter, which keeps every message of the sandbox's off them, and
comms.py keeps the frontend's messages on them from the sandbox.

Closing a model's comm removes its views from the page (ipywidgets' WidgetModel.close), so
at the end the display becomes the outcome's text line first: a saved notebook then holds no
view of a model that is gone.
"""

from __future__ import annotations

import uuid
from typing import Any, Protocol

from sandbox_kernel.kernel.output import KERNEL_METADATA, CellOutput
from sandbox_kernel.kernel.output_safety import WIDGET_TARGET, WIDGET_VIEW, OutputFilter

# ipywidgets 8 (jupyterlab_widgets 3): the comm protocol, and the version of its controls
# module, from which the frontend loads the models and views.
PROTOCOL_VERSION = "2.1.0"
CONTROLS = "@jupyter-widgets/controls"
MODULE_VERSION = "2.0.0"


class CountProgress(Protocol):
    def count(self, done: int, failed: int) -> None:
        """`done` of the total have ended, `failed` of them failed."""

    def end(self, text: str | None) -> None:
        """The progress is over: show `text` (None: as it stands, e.g. after an interrupt)."""


def count_progress(out: CellOutput, output_filter: OutputFilter, headline: str, total: int) -> CountProgress:
    """A widget bar where a frontend showed it has a widget manager and updates displays in
    place (not a terminal), else a text line."""
    if output_filter.frontend_has_widgets and out.in_place:
        return WidgetCount(out, output_filter, headline, total)
    return TextCount(out, headline, total)


def counted(headline: str, done: int, total: int, failed: int) -> str:
    """E.g. 'Sweeping 5 branch(es) over forks of sb-1: 2 of 5 done, 1 failed'."""
    return f"{headline}: {done} of {total} done" + (f", {failed} failed" if failed else "")


class TextCount:
    def __init__(self, out: CellOutput, headline: str, total: int) -> None:
        self.headline, self.total = headline, total
        self.line = out.progress(counted(headline, 0, total, 0))

    def count(self, done: int, failed: int) -> None:
        self.line.update(counted(self.headline, done, self.total, failed))

    def end(self, text: str | None) -> None:
        if text is not None:
            self.line.update(text)


class WidgetCount:
    def __init__(self, out: CellOutput, output_filter: OutputFilter, headline: str, total: int) -> None:
        self.out, self.headline, self.total = out, headline, total
        self.text = counted(headline, 0, total, 0)  # the label's, and the display's for frontends without widgets
        self.bar, self.label, self.box = (output_filter.new_host_comm() for _ in range(3))
        self.open = True
        self._open(self.bar, model("IntProgressModel", "ProgressView", value=0, min=0, max=total,
                                   bar_style="", orientation="horizontal"))
        self._open(self.label, model("LabelModel", "LabelView", value=self.text))
        self._open(self.box, model("HBoxModel", "HBoxView", box_style="",
                                   children=[f"IPY_MODEL_{self.bar}", f"IPY_MODEL_{self.label}"]))
        self.display_id = uuid.uuid4().hex
        out.display({WIDGET_VIEW: {"version_major": 2, "version_minor": 0, "model_id": self.box},
                     "text/plain": self.text}, self.display_id, metadata=KERNEL_METADATA)

    def count(self, done: int, failed: int) -> None:
        self.text = counted(self.headline, done, self.total, failed)
        self._update(self.bar, value=done, bar_style="danger" if failed else "")
        self._update(self.label, value=self.text)

    def end(self, text: str | None) -> None:
        """The display becomes the text line, then the models are closed (their views with
        them); once only."""
        if not self.open:
            return
        self.open = False
        self.out.display({"text/plain": text if text is not None else self.text}, self.display_id, update=True,
                         metadata=KERNEL_METADATA)
        for comm_id in (self.box, self.label, self.bar):
            self.out.comm("comm_close", {"comm_id": comm_id, "data": {}})

    def _open(self, comm_id: str, state: dict[str, Any]) -> None:
        self.out.comm("comm_open", {"comm_id": comm_id, "target_name": WIDGET_TARGET,
                                    "data": {"state": state, "buffer_paths": []}},
                      {"version": PROTOCOL_VERSION})

    def _update(self, comm_id: str, **state: Any) -> None:
        self.out.comm("comm_msg", {"comm_id": comm_id,
                                   "data": {"method": "update", "state": state, "buffer_paths": []}})


def model(name: str, view: str, **state: Any) -> dict[str, Any]:
    """A controls model's state: what it is (the frontend loads it by these), then its fields
    (the frontend gives the others their defaults, as for ipywidgets' own)."""
    return {"_model_module": CONTROLS, "_model_module_version": MODULE_VERSION, "_model_name": name,
            "_view_module": CONTROLS, "_view_module_version": MODULE_VERSION, "_view_name": view, **state}
