"""The kernel's own progress (progress_widget.py) as the messages it sends: a text line, or
ipywidgets' comm protocol spoken by the kernel, checked against ipywidgets' own models; and
the output filter keeping the sandbox's messages off the kernel's comms. The bar in a real
JupyterLab: tests/browser/test_widgets_browser.py."""

from __future__ import annotations

from typing import Any

import ipywidgets
import pytest
from ipywidgets import _version as ipywidgets_version

from sandbox_kernel.kernel.output import CellOutput
from sandbox_kernel.kernel.output_safety import WIDGET_CONTROL_TARGET, WIDGET_VIEW, OutputFilter
from sandbox_kernel.kernel.progress_widget import MODULE_VERSION, PROTOCOL_VERSION, count_progress

HEADLINE = "Sweeping 3 branch(es) over forks of sb-1"

Sent = list[tuple[str, dict[str, Any], dict[str, Any] | None]]


def recording(in_place: bool = True) -> tuple[CellOutput, Sent]:
    sent: Sent = []
    return CellOutput(lambda kind, content, metadata=None: sent.append((kind, content, metadata)), in_place), sent


def with_widget_manager() -> OutputFilter:
    """A filter that saw a frontend open ipywidgets' control comm, as JupyterLab's widget manager does."""
    output_filter = OutputFilter()
    output_filter.comm_from_frontend("comm_open", {"comm_id": "control", "target_name": WIDGET_CONTROL_TARGET,
                                                   "data": {}})
    return output_filter


def run_progress(output_filter: OutputFilter, in_place: bool = True, outcome: str | None = "Swept 3") -> Sent:
    out, sent = recording(in_place)
    progress = count_progress(out, output_filter, HEADLINE, 3)
    progress.count(1, 0)
    progress.count(2, 1)
    progress.end(outcome)
    progress.end(outcome)  # a second end (a finally after the normal one) sends nothing
    return sent


def test_without_a_widget_manager_the_progress_is_one_text_line() -> None:
    sent = run_progress(OutputFilter())
    kinds = [kind for kind, _, _ in sent]
    assert kinds == ["display_data", "update_display_data", "update_display_data", "update_display_data",
                     "update_display_data"]
    texts = [content["data"] for _, content, _ in sent]
    assert texts[:4] == [{"text/plain": f"{HEADLINE}: 0 of 3 done"}, {"text/plain": f"{HEADLINE}: 1 of 3 done"},
                         {"text/plain": f"{HEADLINE}: 2 of 3 done, 1 failed"}, {"text/plain": "Swept 3"}]
    assert len({content["transient"]["display_id"] for _, content, _ in sent}) == 1


def test_a_frontend_without_in_place_updates_gets_the_text_line_even_with_widgets() -> None:
    """jupyter console beside JupyterLab: a widget view would be one stale line there."""
    sent = run_progress(with_widget_manager(), in_place=False)
    assert {kind for kind, _, _ in sent} == {"display_data"}


def test_only_the_control_comm_tells_of_a_widget_manager() -> None:
    output_filter = OutputFilter()
    output_filter.comm_from_frontend("comm_open", {"comm_id": "c", "target_name": "jupyter.widget", "data": {}})
    output_filter.comm_from_frontend("comm_msg", {"comm_id": "d", "target_name": WIDGET_CONTROL_TARGET})
    assert not output_filter.frontend_has_widgets
    assert with_widget_manager().frontend_has_widgets


def test_with_a_widget_manager_the_kernel_opens_shows_updates_and_closes_a_bar() -> None:
    output_filter = with_widget_manager()
    sent = run_progress(output_filter)
    assert [kind for kind, _, _ in sent] == ["comm_open"] * 3 + ["display_data"] + ["comm_msg"] * 4 + [
        "update_display_data"] + ["comm_close"] * 3
    opens = {content["data"]["state"]["_model_name"]: content for kind, content, _ in sent if kind == "comm_open"}
    assert all(metadata == {"version": PROTOCOL_VERSION} for kind, _, metadata in sent if kind == "comm_open")
    assert all(content["target_name"] == "jupyter.widget" and content["data"]["buffer_paths"] == []
               for content in opens.values())
    bar, label, box = (opens[name]["comm_id"] for name in ("IntProgressModel", "LabelModel", "HBoxModel"))
    # The kernel's own comms: registered as host state, ids of no other comm.
    assert {bar, label, box} <= output_filter.host_comms and len({bar, label, box, "control"}) == 4
    assert opens["HBoxModel"]["data"]["state"]["children"] == [f"IPY_MODEL_{bar}", f"IPY_MODEL_{label}"]
    assert opens["IntProgressModel"]["data"]["state"]["max"] == 3
    assert opens["LabelModel"]["data"]["state"]["value"] == f"{HEADLINE}: 0 of 3 done"

    shown = sent[3][1]
    assert shown["data"] == {WIDGET_VIEW: {"version_major": 2, "version_minor": 0, "model_id": box},
                             "text/plain": f"{HEADLINE}: 0 of 3 done"}
    updates = [(content["comm_id"], content["data"]) for kind, content, _ in sent if kind == "comm_msg"]
    assert updates == [
        (bar, {"method": "update", "state": {"value": 1, "bar_style": ""}, "buffer_paths": []}),
        (label, {"method": "update", "state": {"value": f"{HEADLINE}: 1 of 3 done"}, "buffer_paths": []}),
        (bar, {"method": "update", "state": {"value": 2, "bar_style": "danger"}, "buffer_paths": []}),
        (label, {"method": "update", "state": {"value": f"{HEADLINE}: 2 of 3 done, 1 failed"},
                 "buffer_paths": []})]
    # The display becomes the outcome's line before the models (and with them their views) go.
    replaced = sent[8][1]
    assert replaced["data"] == {"text/plain": "Swept 3"}
    assert replaced["transient"] == shown["transient"]
    assert [content for kind, content, _ in sent if kind == "comm_close"] == [
        {"comm_id": comm_id, "data": {}} for comm_id in (box, label, bar)]


def test_an_interrupted_bar_leaves_its_last_line() -> None:
    sent = run_progress(with_widget_manager(), outcome=None)
    assert sent[8][1]["data"] == {"text/plain": f"{HEADLINE}: 2 of 3 done, 1 failed"}


def test_the_models_are_ipywidgets_own_as_the_installed_frontend_expects_them() -> None:
    """Every field the kernel sends has the value ipywidgets' Python side sends for the same
    widget: names, modules and their versions (those the installed jupyterlab_widgets serves)."""
    assert PROTOCOL_VERSION == ipywidgets_version.__protocol_version__
    assert MODULE_VERSION == ipywidgets_version.__jupyter_widgets_controls_version__
    sent = run_progress(with_widget_manager())
    states = {content["data"]["state"]["_model_name"]: content["data"]["state"]
              for kind, content, _ in sent if kind == "comm_open"}
    theirs = {
        "IntProgressModel": ipywidgets.IntProgress(value=0, min=0, max=3),
        "LabelModel": ipywidgets.Label(value=f"{HEADLINE}: 0 of 3 done"),
        "HBoxModel": ipywidgets.HBox(),
    }
    for name, widget in theirs.items():
        their_state = widget.get_state()
        assert {key: value for key, value in states[name].items() if key != "children"} == {
            key: their_state[key] for key in states[name] if key != "children"}, name


@pytest.mark.parametrize("trusted", [False, True])
def test_the_sandbox_cannot_reach_the_kernels_comms(trusted: bool) -> None:
    output_filter = with_widget_manager()
    output_filter.trusted = trusted
    sent = run_progress(output_filter)
    bar = next(content["comm_id"] for kind, content, _ in sent if kind == "comm_open")
    state = {"_model_module": "@jupyter-widgets/controls", "_view_module": "@jupyter-widgets/controls",
             "_model_name": "IntProgressModel", "_view_name": "ProgressView", "value": 0}
    for msg_type, data in (("comm_open", {"state": state}), ("comm_msg", {"method": "update", "state": {"value": 0}}),
                           ("comm_close", {})):
        content = {"comm_id": bar, "target_name": "jupyter.widget", "data": data}
        assert output_filter.comm_from_sandbox(msg_type, content, []) is None, msg_type
    # Nor in the states the sandbox reports on the frontend's control comm.
    answer = output_filter.comm_from_sandbox("comm_msg", {"comm_id": "control", "data": {
        "method": "update_states", "states": {bar: {"state": state}, "own": {"state": state}}, "buffer_paths": []}}, [])
    assert answer is not None
    if not trusted:  # trusted output passes unchanged: the page asked the sandbox for its states
        assert list(answer[0]["data"]["states"]) == ["own"]
    assert output_filter.is_host_comm(bar) and not output_filter.is_host_comm(["not", "an", "id"])
