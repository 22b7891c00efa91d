"""%sandbox sweep's progress bar, through a real kernel and sandbox: the kernel's own widget
(kernel/progress_widget.py) for a client that opened ipywidgets' control comm, as JupyterLab's
widget manager does; its comms stay the host's in both directions. The bar as JupyterLab
renders it: tests/browser/test_widgets_browser.py."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from jupyter_client.blocking.client import BlockingKernelClient

from kernel_helpers import TIMEOUT, Execution, execute, running_kernel
from message_spec import validate

pytestmark = pytest.mark.slow

# In the sandbox: every comm id the frontend's comm_msg and comm_close messages reach there.
SPY = """
import comm
manager = comm.get_comm_manager()
reached = []
for kind in ("comm_msg", "comm_close"):
    def spy(stream, ident, msg, original=getattr(manager, kind)):
        reached.append(msg["content"]["comm_id"])
        return original(stream, ident, msg)
    setattr(manager, kind, spy)
"""


def displays(execution: Execution) -> list[dict[str, Any]]:
    """The cell's displays, the kernel's own lines (Execution.outputs leaves them out) included."""
    return [m for m in execution.messages if m["msg_type"] in ("display_data", "update_display_data")]


def send_comm(kc: BlockingKernelClient, msg_type: str, content: dict[str, Any]) -> None:
    """A frontend's comm message; returns once the kernel has handled it (its idle status)."""
    msg = kc.session.msg(msg_type, content, metadata={"version": "2.1.0"})
    kc.shell_channel.send(msg)
    while True:
        status = kc.get_iopub_msg(timeout=TIMEOUT)
        validate(status)
        if status["parent_header"].get("msg_id") == msg["header"]["msg_id"] and \
                status["msg_type"] == "status" and status["content"]["execution_state"] == "idle":
            return


def open_control_comm(kc: BlockingKernelClient) -> None:
    """What JupyterLab's widget manager does when it meets a kernel."""
    send_comm(kc, "comm_open", {"comm_id": uuid.uuid4().hex, "target_name": "jupyter.widget.control", "data": {}})


def test_a_sweep_shows_a_widget_bar_to_a_widget_manager_and_keeps_its_comms_on_the_host(kernelspec: str) -> None:
    with running_kernel(kernelspec) as (_, kc):
        assert execute(kc, SPY).reply["content"]["status"] == "ok"
        open_control_comm(kc)
        sweep = execute(kc, "%sandbox sweep -p x 1 2 3 --jobs 2 -- x * 10")
        assert sweep.reply["content"]["status"] == "ok"
        comms = [m for m in sweep.messages if m["msg_type"].startswith("comm_")]
        opens = {m["content"]["data"]["state"]["_model_name"]: m["content"]["comm_id"]
                 for m in comms if m["msg_type"] == "comm_open"}
        assert set(opens) == {"IntProgressModel", "LabelModel", "HBoxModel"}
        bar, label = opens["IntProgressModel"], opens["LabelModel"]
        values = [m["content"]["data"]["state"]["value"] for m in comms
                  if m["msg_type"] == "comm_msg" and m["content"]["comm_id"] == bar]
        assert sorted(values) == [1, 2, 3]
        labels = [m["content"]["data"]["state"]["value"] for m in comms
                  if m["msg_type"] == "comm_msg" and m["content"]["comm_id"] == label]
        assert labels[-1].endswith(": 3 of 3 done")
        assert {m["content"]["comm_id"] for m in comms if m["msg_type"] == "comm_close"} == set(opens.values())
        # The cell shows the bar's view, then in its place the outcome, then the table.
        shown, replaced, table = displays(sweep)
        assert shown["content"]["data"]["application/vnd.jupyter.widget-view+json"]["model_id"] == opens["HBoxModel"]
        assert replaced["msg_type"] == "update_display_data"
        assert replaced["content"]["transient"] == shown["content"]["transient"]
        assert replaced["content"]["data"]["text/plain"].endswith("; every fork destroyed")
        assert table["content"]["data"]["text/plain"].splitlines()[1].split() == ["x=1", "ok", "10"]

        # The page's messages on the bar stay on the host; others reach the sandbox.
        probe = uuid.uuid4().hex
        for comm_id in (bar, probe):
            send_comm(kc, "comm_msg", {"comm_id": comm_id, "data": {"method": "request_state"}})
        assert execute(kc, "print(reached)").text() == f"[{probe!r}]\n"

        # Nor can the sandbox open, update or close the kernel's comms.
        forged = execute(kc, f"""
c = comm.create_comm(comm_id={bar!r}, target_name="jupyter.widget", data={{"state": {{
    "_model_module": "@jupyter-widgets/controls", "_model_name": "IntProgressModel",
    "_view_module": "@jupyter-widgets/controls", "_view_name": "ProgressView", "value": 0}}}})
c.send({{"method": "update", "state": {{"value": 0}}}})
c.close()
print("sent")""")
        assert forged.text() == "sent\n"
        assert not [m for m in forged.messages if m["msg_type"].startswith("comm_")]


def test_a_client_without_a_widget_manager_gets_the_text_line(kernelspec: str) -> None:
    with running_kernel(kernelspec) as (_, kc):
        sweep = execute(kc, "%sandbox sweep -p x 1 2 -- x")
        assert not [m for m in sweep.messages if m["msg_type"].startswith("comm_")]
        texts = [m["content"]["data"]["text/plain"] for m in displays(sweep)[:-1]]
        assert texts[0].endswith(": 0 of 2 done") and texts[-1].endswith("; every fork destroyed")


def test_an_interrupted_sweep_closes_its_bar(kernelspec: str) -> None:
    with running_kernel(kernelspec) as (km, kc):
        open_control_comm(kc)
        msg_id = kc.execute("%sandbox sweep -p x 1 2 --jobs 2 -- import time; time.sleep(600)")
        messages = []
        while not any(m["msg_type"] == "display_data" for m in messages):  # the bar is shown
            messages.append(kc.get_iopub_msg(timeout=TIMEOUT))
        km.interrupt_kernel()
        while not (messages[-1]["msg_type"] == "status" and messages[-1]["content"]["execution_state"] == "idle"
                   and messages[-1]["parent_header"].get("msg_id") == msg_id):
            messages.append(kc.get_iopub_msg(timeout=TIMEOUT))
        for msg in messages:
            validate(msg)
        opened = {m["content"]["comm_id"] for m in messages if m["msg_type"] == "comm_open"}
        assert len(opened) == 3
        assert {m["content"]["comm_id"] for m in messages if m["msg_type"] == "comm_close"} == opened
        last_line = [m["content"]["data"] for m in messages if m["msg_type"] == "update_display_data"][-1]
        assert last_line == {"text/plain": last_line["text/plain"]} and " of 2 done" in last_line["text/plain"]
        while (reply := kc.get_shell_msg(timeout=TIMEOUT))["parent_header"].get("msg_id") != msg_id:
            pass
        assert reply["content"]["ename"] == "KeyboardInterrupt"
