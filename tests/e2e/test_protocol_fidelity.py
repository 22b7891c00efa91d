"""What ipykernel does that a frontend or a peer test suite relies on, across the sandbox
boundary: no output nobody asked for, honest kernel_info, user_expressions, stdin errors,
pager and next-input payloads, an asyncio loop, an interruptible pdb, subprocess output,
usage_request. Every message received is checked against the messaging spec (message_spec.py).
"""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.blocking.client import BlockingKernelClient
from jupyter_client.manager import KernelManager

from fault_proxy import proxied_engine
from kernel_helpers import (PROVIDER, TIMEOUT, Execution, execute, is_status_line, plain_traceback, running_kernel,
                            wait_busy_then_idle)
from message_spec import validate
from sandbox_kernel.guest import bundle as runner_bundle
from sandbox_kernel.local.service import EngineEndpoint
from sandbox_kernel.sandbox.runner_setup import RUNNER_DIR

pytestmark = [pytest.mark.slow, pytest.mark.one_path]


def run(kc: BlockingKernelClient, code: str, **kwargs: Any) -> Execution:
    """Execute, checking the reply and every iopub message against the spec."""
    result = execute(kc, code, **kwargs)
    for msg in [result.reply, *result.messages]:
        validate(msg)
    return result


def control(kc: BlockingKernelClient, msg_type: str, content: dict[str, Any]) -> dict[str, Any]:
    """A control-channel request and its (validated) reply."""
    msg = kc.session.msg(msg_type, content)
    kc.control_channel.send(msg)
    while True:
        reply = kc.control_channel.get_msg(timeout=TIMEOUT)
        if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
            validate(reply)
            return reply


# -- 1. no output the user did not ask for ------------------------------------------------

def test_a_silent_first_execution_outputs_nothing(kernelspec: str) -> None:
    with running_kernel(kernelspec) as (_, kc):
        silent_id = kc.execute("x = 1", silent=True)
        reply = kc.get_shell_msg(timeout=TIMEOUT)
        while reply["parent_header"]["msg_id"] != silent_id:  # the start's kernel_info_reply
            reply = kc.get_shell_msg(timeout=TIMEOUT)
        validate(reply)
        assert reply["content"]["status"] == "ok"
        first = run(kc, "x + 1")
        assert [m["msg_type"] for m in first.messages if m["msg_type"] != "status"] == \
            ["execute_input", "execute_result"]
        seen = []
        while True:  # everything iopub carried, the silent execution's included
            try:
                seen.append(kc.get_iopub_msg(timeout=0.5))
            except queue.Empty:
                break
        assert not [m for m in seen if m["parent_header"].get("msg_id") == silent_id
                    and m["msg_type"] not in ("status",)], "a silent execution shows nothing"


def test_the_ready_line_is_an_opt_in(kernelspec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDBOX_KERNEL_SHOW_READY", "true")
    with running_kernel(kernelspec) as (_, kc):
        [line] = [m for m in run(kc, "1").messages if is_status_line(m)]
        assert f"ready on {PROVIDER}" in line["content"]["data"]["text/plain"]
        assert not [m for m in run(kc, "2").messages if is_status_line(m)]


@contextlib.contextmanager
def slowly_starting_kernel(kernelspec: str, engine: EngineEndpoint,
                           monkeypatch: pytest.MonkeyPatch) -> Iterator[BlockingKernelClient]:
    """A kernel whose sandbox's create is answered "429, retry after 4 s" (as CreateOS may):
    the kernel shows progress after 2 s, and requests come while the sandbox starts."""
    slow_down = (b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\n"
                 b"Retry-After: 4\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}")
    with proxied_engine(engine, monkeypatch, create_replies=[slow_down]):
        km = KernelManager(kernel_name=kernelspec)
        km.start_kernel()
        kc = km.client()
        kc.start_channels()
        try:
            yield kc
        finally:
            kc.stop_channels()
            km.shutdown_kernel()


def test_a_slow_start_shows_progress_that_becomes_the_ready_line(
        kernelspec: str, engine: EngineEndpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    # The cell is sent at once, without waiting for kernel_info (which waits for the sandbox).
    with slowly_starting_kernel(kernelspec, engine, monkeypatch) as kc:
        first = run(kc, "print('ran')")
    lines = [m["content"] for m in first.messages if is_status_line(m)]
    assert lines[0]["data"]["text/plain"] == "Starting a sandbox on CreateOS…"
    assert "ready on CreateOS" in lines[-1]["data"]["text/plain"]
    assert lines[-1]["transient"]["display_id"] == lines[0]["transient"]["display_id"]
    assert first.text() == "ran\n"


# -- 2. kernel_info says only what works ----------------------------------------------------

def test_kernel_info_advertises_what_works(kc: BlockingKernelClient) -> None:
    info = kc.kernel_info(reply=True, timeout=TIMEOUT)
    validate(info)
    # As ipykernel lists them: subshells (test_subshells.py) and the debugger (test_debugger.py).
    assert info["content"]["supported_features"] == ["kernel subshells", "debugger"]
    assert control(kc, "list_subshell_request", {})["content"] == {"status": "ok", "subshell_id": []}


# -- 3. user_expressions --------------------------------------------------------------------

def test_user_expressions_are_evaluated_in_the_sandbox(kc: BlockingKernelClient) -> None:
    result = run(kc, "import socket\nanswer = 6", user_expressions={
        "product": "answer * 7", "where": "socket.gethostname()", "broken": "1 / 0"})
    found = result.reply["content"]["user_expressions"]
    assert found["product"] == {"status": "ok", "data": {"text/plain": "42"}, "metadata": {}}
    assert found["where"]["data"]["text/plain"] == repr(run(kc, "import socket; print(socket.gethostname())")
                                                        .text().strip())
    assert found["broken"]["status"] == "error" and found["broken"]["ename"] == "ZeroDivisionError"
    # An empty cell evaluates them too; a failed one does not (as under ipykernel).
    assert run(kc, "", user_expressions={"a": "answer"}).reply["content"]["user_expressions"]["a"]["data"] == \
        {"text/plain": "6"}
    failed = run(kc, "1 / 0", user_expressions={"a": "answer"}).reply["content"]
    assert failed["status"] == "error" and not failed.get("user_expressions")


# -- 4. input() without stdin ---------------------------------------------------------------

def test_input_without_stdin_raises_stdin_not_implemented(kc: BlockingKernelClient) -> None:
    result = run(kc, "input('name? ')", allow_stdin=False)
    assert result.reply["content"]["ename"] == "StdinNotImplementedError"
    assert not [m for m in result.messages if m["msg_type"] == "input_request"]
    asked = run(kc, "print(input('name? '))", allow_stdin=True,
                stdin_hook=lambda msg: kc.input("Ada"))
    assert asked.text() == "Ada\n"


# -- 5. payloads ----------------------------------------------------------------------------

def test_help_goes_to_the_pager_not_to_stdout(kc: BlockingKernelClient) -> None:
    for code in ("len?", "len??", "%pinfo len", "%pdoc len"):
        result = run(kc, code)
        assert result.text() == "", f"{code} printed to stdout"
        [page] = result.reply["content"]["payload"]
        assert page["source"] == "page" and "Return the number of items" in page["data"]["text/plain"]


def test_load_and_recall_set_the_next_input(kc: BlockingKernelClient) -> None:
    run(kc, "with open('snippet.py', 'w') as f:\n    f.write('print(\"loaded\")\\n')")
    [load] = run(kc, "%load snippet.py").reply["content"]["payload"]
    assert load == {"source": "set_next_input", "text": '# %load snippet.py\nprint("loaded")\n', "replace": True}
    previous = run(kc, "recalled = 1")
    count = previous.reply["content"]["execution_count"]
    run(kc, "%sandbox status")  # numbered by the kernel, run on the host: the numbers stay aligned
    [recall] = run(kc, f"%recall {count}").reply["content"]["payload"]
    assert recall["source"] == "set_next_input" and recall["text"] == "recalled = 1"


# -- 6. an asyncio event loop in and between cells ------------------------------------------

def test_cells_run_on_an_event_loop(kc: BlockingKernelClient) -> None:
    assert "running=True" in run(kc, "import asyncio\nasyncio.get_running_loop()") \
        .of_type("execute_result")[0]["data"]["text/plain"]
    awaited = run(kc, "await asyncio.sleep(0)\n'awaited'")
    assert awaited.of_type("execute_result")[0]["data"]["text/plain"] == "'awaited'"
    # A task started by a cell that never awaits runs once the cell has ended.
    run(kc, "import threading\nran = threading.Event()\n"
            "async def mark():\n    ran.set()\n"
            "task = asyncio.get_running_loop().create_task(mark())")
    assert run(kc, "ran.is_set(), task.done()").of_type("execute_result")[0]["data"]["text/plain"] == \
        "(True, True)"


def test_an_error_whose_traceback_display_is_interrupted_is_still_named(
        kernel: tuple[KernelManager, BlockingKernelClient]) -> None:
    """IPython prints only "KeyboardInterrupt" when an interrupt lands while it shows an error
    (under load: a second interrupt while it formats the first one's CancelledError), and
    shows no error: the reply still names the error, as ipykernel's does. The interrupt is
    made to land there by a display that raises it."""
    _, kc = kernel
    run(kc, "def _cut_short(*args):\n    raise KeyboardInterrupt\nget_ipython()._showtraceback = _cut_short")
    try:
        cut = run(kc, "raise ValueError('the error')")
    finally:
        run(kc, "del get_ipython()._showtraceback")
    assert "KeyboardInterrupt" in cut.text("stderr"), "the display was cut short"
    assert [error["ename"] for error in cut.of_type("error")] == ["ValueError"]
    assert (cut.reply["content"]["status"], cut.reply["content"]["ename"], cut.reply["content"]["evalue"]) == \
        ("error", "ValueError", "the error")
    assert run(kc, "1 / 0").reply["content"]["ename"] == "ZeroDivisionError", "the display is back"


def test_an_interrupt_cancels_an_awaiting_cell(kernel: tuple[KernelManager, BlockingKernelClient]) -> None:
    km, kc = kernel

    def interrupt_once_waiting(msg: dict[str, Any]) -> None:
        if msg["msg_type"] == "stream" and "waiting" in msg["content"]["text"]:
            km.interrupt_kernel()

    messages: list[dict[str, Any]] = []
    reply = kc.execute_interactive("import asyncio\nprint('waiting', flush=True)\nawait asyncio.sleep(600)",
                                   output_hook=lambda m: (messages.append(m), interrupt_once_waiting(m)),
                                   timeout=TIMEOUT)
    assert reply["content"]["status"] == "error"
    assert reply["content"]["ename"] in ("CancelledError", "KeyboardInterrupt")
    assert run(kc, "'alive'").of_type("execute_result")[0]["data"]["text/plain"] == "'alive'"


# -- 7. pdb -----------------------------------------------------------------------------------

def test_pdb_reads_the_frontends_stdin_and_an_interrupt_ends_it(
        kernel: tuple[KernelManager, BlockingKernelClient]) -> None:
    km, kc = kernel
    answers = iter(["p secret * 2", "c"])
    debugged = run(kc, "import pdb\nsecret = 21\npdb.set_trace()\nprint('after')", allow_stdin=True,
                   stdin_hook=lambda msg: kc.input(next(answers)))
    assert "42" in debugged.text() and debugged.text().endswith("after\n")
    # An interrupt at the prompt ends the debugger and the cell goes on, as under ipykernel
    # (plain pdb would catch it and ask again: the cell would never end).
    asked: list[dict[str, Any]] = []
    interrupted = run(kc, "pdb.set_trace()\nprint('went on')", allow_stdin=True,
                      stdin_hook=lambda msg: (asked.append(msg), km.interrupt_kernel()))
    assert len(asked) == 1
    assert "--KeyboardInterrupt--" in interrupted.text() and interrupted.text().endswith("went on\n")
    # The question left unanswered does not hold up the next one.
    again = run(kc, "print(input())", allow_stdin=True, stdin_hook=lambda msg: kc.input("next"))
    assert again.text() == "next\n"


# -- 8. output of subprocesses and forked children ------------------------------------------

def test_output_of_subprocesses_and_multiprocessing_children(kc: BlockingKernelClient) -> None:
    spawned = run(kc, "import subprocess, sys\n"
                      "subprocess.run([sys.executable, '-c', 'import os; os.write(2, b\"to fd 2\\\\n\")']);")
    assert spawned.text("stderr") == "to fd 2\n"
    printed = run(kc, "import multiprocessing as mp\n"
                      "p = mp.get_context('fork').Process(target=print, args=('from the child',))\n"
                      "p.start(); p.join()")
    assert printed.text() == "from the child\n"
    failed = run(kc, "p = mp.get_context('fork').Process(target=int, args=('hi',))\np.start(); p.join()")
    assert failed.reply["content"]["status"] == "ok" and failed.text() == ""
    assert "ValueError: invalid literal for int()" in failed.text("stderr")
    assert "Traceback" in plain_traceback([failed.text("stderr")])


# -- 10. sys.path, matplotlib, display errors -------------------------------------------------

def test_imports_look_in_the_working_directory_first(kc: BlockingKernelClient) -> None:
    run(kc, "with open('local_module_here.py', 'w') as f:\n    f.write('VALUE = 7\\n')")
    result = run(kc, "import sys, local_module_here\nsys.path[0], local_module_here.VALUE")
    assert result.of_type("execute_result")[0]["data"]["text/plain"] == "('', 7)"


def test_a_users_module_named_like_one_of_the_runners_is_the_users(kc: BlockingKernelClient) -> None:
    """The runner's modules are modules of its own package in the sandbox: none is in
    sys.modules under a bare name a user's import would take (runner_protocol was, before),
    and no directory of the runner's is on sys.path."""
    ours = sorted({Path(path).stem for path in runner_bundle.runner_files()} - {"__init__", "__main__"}
                  | {"runner_protocol", "runner_bundle", "runner_debug", "runner_fork"})
    found = run(kc, f"import sys\nprint(sorted(name for name in {ours!r} if name in sys.modules))")
    assert found.text() == "[]\n"
    run(kc, "for name in ('protocol', 'runner_protocol'):\n"
            "    with open(name + '.py', 'w') as f:\n        f.write('OWNER = \"user\"\\n')")
    mine = run(kc, "import os, protocol, runner_protocol, sys\nos.remove('protocol.py'); os.remove('runner_protocol.py')\n"
                   f"print(protocol.OWNER, runner_protocol.OWNER, [p for p in sys.path if {RUNNER_DIR!r} in p])")
    assert mine.text() == "user user []\n"


def test_matplotlib_is_inline_on_import(kc: BlockingKernelClient) -> None:
    result = run(kc, "import matplotlib, matplotlib.pyplot as plt\nbackend = matplotlib.get_backend()",
                 user_expressions={"backend": "backend"})
    assert "backend_inline" in result.reply["content"]["user_expressions"]["backend"]["data"]["text/plain"]


def test_a_failing_repr_fails_the_cell_as_under_ipykernel(kc: BlockingKernelClient) -> None:
    code = "class Bad:\n    def _repr_html_(self):\n        raise ValueError('bad html')\n"
    result = run(kc, code + "Bad()")
    reply = result.reply["content"]
    assert (reply["status"], reply["ename"], reply["evalue"]) == ("error", "ValueError", "bad html")
    # The plain-text repr is still shown, after the error.
    assert [m["msg_type"] for m in result.outputs] == ["error", "execute_result"]
    # display() of it shows the error and the text, and the cell succeeds (ipykernel does the same).
    shown = run(kc, "display(Bad())")
    assert shown.reply["content"]["status"] == "ok"
    assert [m["msg_type"] for m in shown.outputs] == ["error", "display_data"]


# -- 9. usage_request -------------------------------------------------------------------------

PANEL_FIELDS = {"hostname", "pid", "kernel_cpu", "kernel_memory", "host_cpu_percent", "cpu_count",
                "host_virtual_memory"}
PANEL_MEMORY_FIELDS = {"active", "available", "free", "inactive", "percent", "total", "used"}


def assert_has_the_panels_fields(usage: dict[str, Any]) -> None:
    """What jupyter-resource-usage's kernel panel reads (it reads host_virtual_memory.active
    unguarded: one reply without it breaks the panel for the page's life)."""
    assert PANEL_FIELDS <= set(usage), usage
    assert PANEL_MEMORY_FIELDS <= set(usage["host_virtual_memory"]), usage


def test_usage_reply_measures_the_sandbox(kc: BlockingKernelClient) -> None:
    hostname = run(kc, "import os, socket\nprint(socket.gethostname())").text().strip()
    first = control(kc, "usage_request", {})["content"]  # the first sample starts the CPU measurement
    assert_has_the_panels_fields(first)
    assert "reason" not in first and first["host_cpu_percent"] is None, "not known before a second sample"
    run(kc, "ballast = b'x' * (200 * 2**20)")
    usage = control(kc, "usage_request", {})["content"]
    assert_has_the_panels_fields(usage)
    assert "reason" not in usage
    assert usage["hostname"] == hostname  # the sandbox's, not this machine's
    assert usage["pid"] == int(run(kc, "print(os.getpid())").text())
    assert usage["kernel_memory"] >= 200 * 2**20
    assert usage["kernel_cpu"] >= 0 and usage["cpu_count"] >= 1 and 0 <= usage["host_cpu_percent"] <= 100
    memory = usage["host_virtual_memory"]
    assert memory["total"] <= 1024 * 2**20, "the sandbox's memory (its shape's), not the host's"
    assert memory["used"] >= 200 * 2**20 and memory["used"] + memory["available"] == memory["total"]
    run(kc, "del ballast")


def test_usage_reply_while_the_sandbox_starts_has_the_fields_and_says_loading(
        kernelspec: str, engine: EngineEndpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    # The panel asks while the sandbox is still starting.
    with slowly_starting_kernel(kernelspec, engine, monkeypatch) as kc:
        early = control(kc, "usage_request", {})["content"]
        run(kc, "1")
        later = control(kc, "usage_request", {})["content"]
    assert_has_the_panels_fields(early)
    # Nothing is known yet, and it says so (the panel shows "Loading…" for this reason).
    assert early["reason"] == "loading"
    assert early["kernel_memory"] is None and set(early["host_virtual_memory"].values()) == {None}
    assert_has_the_panels_fields(later)
    assert "reason" not in later and later["kernel_memory"] > 0 and later["host_virtual_memory"]["total"] > 0


# -- execute on the control channel ---------------------------------------------------------

def test_an_execute_request_on_the_control_channel_runs_and_its_output_is_its_own(kc: BlockingKernelClient) -> None:
    """ipykernel answers execute_request on the control channel too (jupyter clients use it
    for cells that must not queue behind the shell); the cell runs in the same sandbox."""
    run(kc, "shared = 41")
    request = kc.session.msg("execute_request", {"code": "print(shared + 1)", "silent": False})
    kc.control_channel.send(request)
    reply = None
    while reply is None:
        msg = kc.control_channel.get_msg(timeout=TIMEOUT)
        if msg["parent_header"].get("msg_id") == request["header"]["msg_id"]:
            reply = msg
    validate(reply)
    assert reply["content"]["status"] == "ok"
    printed, parents = "", set()
    while printed != "42\n":  # perhaps in pieces: "42", then the newline
        msg = kc.get_iopub_msg(timeout=TIMEOUT)
        if msg["msg_type"] == "stream":
            printed += msg["content"]["text"]
            parents.add(msg["parent_header"]["msg_id"])
    assert parents == {request["header"]["msg_id"]}


# -- 12. shutdown -------------------------------------------------------------------------------

def test_the_kernel_exits_by_itself_after_shutdown_reply(kernelspec: str) -> None:
    """jupyter_client waits a few seconds (shutdown_wait_time) for the process, then kills
    it: a kernel that lingers after its reply (a thread stuck on a zmq socket) is killed.
    The race showed in about 1 run of 5, hence several runs, each after an interrupted input."""
    for _ in range(5):
        with running_kernel(kernelspec) as (km, kc):
            interrupted = run(kc, "input()", allow_stdin=True, stdin_hook=lambda msg: km.interrupt_kernel())
            assert interrupted.reply["content"]["ename"] == "KeyboardInterrupt"
            process = km.provisioner.process
        assert process.returncode == 0, "killed by jupyter_client: it lingered after shutdown_reply"


# -- 11. comms --------------------------------------------------------------------------------

def comm_messages(result: Execution) -> list[dict[str, Any]]:
    return [m for m in result.messages if m["msg_type"].startswith("comm_")]


def test_a_comm_opened_in_the_sandbox_reaches_the_frontend(kc: BlockingKernelClient) -> None:
    opened = run(kc, "import comm\n"
                     "c = comm.create_comm(target_name='sandbox-test', data={'hello': 1}, buffers=[b'\\x00\\x01bin'])\n"
                     "c.send({'n': 2}, buffers=[b'\\xff' * 3])")
    comm_open, comm_msg = comm_messages(opened)
    for msg in (comm_open, comm_msg):
        validate(msg)
        assert msg["parent_header"]["msg_id"] == opened.reply["parent_header"]["msg_id"]
    assert comm_open["msg_type"] == "comm_open" and comm_open["content"]["target_name"] == "sandbox-test"
    assert comm_open["content"]["data"] == {"hello": 1} and comm_open["buffers"] == [b"\x00\x01bin"]
    assert comm_msg["content"] == {"comm_id": comm_open["content"]["comm_id"], "data": {"n": 2}}
    assert comm_msg["buffers"] == [b"\xff\xff\xff"]
    info = kc.comm_info("sandbox-test", reply=True, timeout=TIMEOUT)["content"]
    assert info == {"status": "ok", "comms": {comm_open["content"]["comm_id"]: {"target_name": "sandbox-test"}}}


def test_the_frontends_comm_messages_reach_the_sandbox(kc: BlockingKernelClient) -> None:
    run(kc, "import comm\nreceived = []\n"
            "def on_open(c, msg):\n"
            "    received.append(('open', msg['content']['data'], [bytes(b) for b in msg['buffers']]))\n"
            "    def on_msg(m):\n"
            "        received.append(('msg', m['content']['data'], [bytes(b) for b in m['buffers']]))\n"
            "        c.send({'echo': m['content']['data']}, buffers=m['buffers'])\n"
            "    c.on_msg(on_msg)\n"
            "comm.get_comm_manager().register_target('echo', on_open)")
    socket = kc.shell_channel.socket
    kc.session.send(socket, "comm_open", {"comm_id": "c-1", "target_name": "echo", "data": {"a": 1}},
                    buffers=[b"\x01\x02"])
    sent = kc.session.send(socket, "comm_msg", {"comm_id": "c-1", "data": {"b": 2}}, buffers=[b"\x00" * 5])
    echo = None
    while echo is None:
        msg = kc.get_iopub_msg(timeout=TIMEOUT)
        if msg["msg_type"] == "comm_msg" and msg["parent_header"].get("msg_id") == sent["header"]["msg_id"]:
            echo = msg
    validate(echo)
    assert echo["content"] == {"comm_id": "c-1", "data": {"echo": {"b": 2}}} and echo["buffers"] == [b"\x00" * 5]
    assert run(kc, "print(received)").text() == \
        "[('open', {'a': 1}, [b'\\x01\\x02']), ('msg', {'b': 2}, [b'\\x00\\x00\\x00\\x00\\x00'])]\n"
    kc.session.send(socket, "comm_close", {"comm_id": "c-1", "data": {}})
    assert "c-1" not in kc.comm_info(reply=True, timeout=TIMEOUT)["content"]["comms"]


def test_a_widget_updated_by_a_thread_after_its_cell_reaches_the_frontend(kc: BlockingKernelClient) -> None:
    """Between cells, the sandbox's comm messages travel on the channel: a progress bar a
    thread moves after its cell ended is updated in the frontend, on that cell's parent."""
    shown = run(kc, "import ipywidgets, threading, time\nbar = ipywidgets.IntProgress(max=3)\n"
                    "def work():\n    time.sleep(0.5)\n    bar.value = 3\n"
                    "threading.Thread(target=work).start()\nbar")
    [view] = shown.of_type("execute_result")
    model_id = view["data"]["application/vnd.jupyter.widget-view+json"]["model_id"]
    update = None
    while update is None:
        msg = kc.get_iopub_msg(timeout=TIMEOUT)
        if msg["msg_type"] == "comm_msg" and msg["content"]["comm_id"] == model_id:
            update = msg
    validate(update)
    assert update["parent_header"]["msg_id"] == shown.reply["parent_header"]["msg_id"]
    assert update["content"]["data"]["method"] == "update" and update["content"]["data"]["state"] == {"value": 3}


def test_a_slider_moved_in_the_frontend_reaches_its_observer(kc: BlockingKernelClient) -> None:
    shown = run(kc, "import ipywidgets\nslider = ipywidgets.IntSlider(value=1)\n"
                    "slider.observe(lambda change: print('now', change['new']), names='value')\nslider")
    [view] = shown.of_type("execute_result")
    model_id = view["data"]["application/vnd.jupyter.widget-view+json"]["model_id"]
    opened = [m["content"] for m in comm_messages(shown) if m["msg_type"] == "comm_open"]
    assert model_id in [content["comm_id"] for content in opened]
    # What JupyterLab sends when the user drags the slider to 7.
    sent = kc.session.send(kc.shell_channel.socket, "comm_msg", {"comm_id": model_id, "data": {
        "method": "update", "state": {"value": 7}, "buffer_paths": []}})
    printed = ""
    while printed != "now 7\n":
        msg = kc.get_iopub_msg(timeout=TIMEOUT)
        if msg["msg_type"] == "stream" and msg["parent_header"].get("msg_id") == sent["header"]["msg_id"]:
            validate(msg)
            printed += msg["content"]["text"]
    assert run(kc, "slider.value").of_type("execute_result")[0]["data"]["text/plain"] == "7"


def test_each_comm_message_of_a_burst_is_busy_then_idle(kc: BlockingKernelClient) -> None:
    """ipywidgets' frontend sends a widget's next change only when the previous one is idle:
    in a burst (a slider moved by keys) every message needs its busy and idle statuses, also
    those that come while the previous one is still being handled in the sandbox."""
    run(kc, "import comm\nseen = []\nburst = comm.create_comm(target_name='burst')\n"
            "burst.on_msg(lambda msg: seen.append(msg['content']['data']['n']))")
    comm_id = next(iter(kc.comm_info("burst", reply=True, timeout=TIMEOUT)["content"]["comms"]))
    sent = [kc.session.send(kc.shell_channel.socket, "comm_msg", {"comm_id": comm_id, "data": {"n": n}})
            for n in range(4)]
    wait_busy_then_idle(kc, [message["header"]["msg_id"] for message in sent])
    assert run(kc, "print(seen)").text() == "[0, 1, 2, 3]\n"


def test_a_comm_message_handled_in_turn_goes_idle_under_its_own_parent(kc: BlockingKernelClient) -> None:
    """The order that made a burst flaky: a comm message comes while the first is handled
    (ipykernel dispatches it concurrently), the first ends, and a third comes while the second
    is still in the sandbox, so it is handled in turn. ipykernel's concurrent dispatch puts the
    shell's parent back when it ends, the parent it saw when it began: the first one's. The
    third then went idle under the first's parent and its own idle never came."""
    run(kc, "import comm, time\nslow = comm.create_comm(target_name='slow')\n"
            "slow.on_msg(lambda msg: time.sleep(msg['content']['data']['sleep']))")
    comm_id = next(iter(kc.comm_info("slow", reply=True, timeout=TIMEOUT)["content"]["comms"]))

    def send(sleep: float) -> str:
        message = kc.session.send(kc.shell_channel.socket, "comm_msg", {"comm_id": comm_id, "data": {"sleep": sleep}})
        return str(message["header"]["msg_id"])

    statuses: dict[str, list[str]] = {send(1): [], send(5): []}  # the second comes while the first sleeps
    first, second = statuses
    third = ""
    order: list[tuple[str, str]] = []
    while any(states != ["busy", "idle"] for states in statuses.values()):
        msg = kc.get_iopub_msg(timeout=TIMEOUT)
        validate(msg)
        parent = msg["parent_header"].get("msg_id")
        if msg["msg_type"] != "status" or parent not in statuses:
            continue
        statuses[parent].append(msg["content"]["execution_state"])
        order.append((parent, msg["content"]["execution_state"]))
        assert len(statuses[parent]) <= 2, statuses
        if parent == first and statuses[first] == ["busy", "idle"]:
            third = send(0)  # the shell is free: handled in turn, while the second sleeps
            statuses[third] = []
    assert order.index((third, "busy")) < order.index((second, "idle")), "the third came after the second ended"
    assert run(kc, "'done'").of_type("execute_result")[0]["data"]["text/plain"] == "'done'"


def test_a_cell_that_awaits_a_widgets_answer_gets_it(kc: BlockingKernelClient) -> None:
    """The frontend's comm message reaches the sandbox while a cell awaits it, and the
    handler's output is shown on the comm message's parent."""
    waiting = kc.execute("import asyncio, comm\nanswer = asyncio.get_running_loop().create_future()\n"
                         "asker = comm.create_comm(target_name='asker')\n"
                         "asker.on_msg(lambda msg: (print('handled'), answer.set_result(msg['content']['data'])))\n"
                         "print('got', await asyncio.wait_for(answer, 30))")
    comm_id = None
    while comm_id is None:
        msg = kc.get_iopub_msg(timeout=TIMEOUT)
        if msg["msg_type"] == "comm_open" and msg["parent_header"].get("msg_id") == waiting:
            comm_id = msg["content"]["comm_id"]
    sent = kc.session.send(kc.shell_channel.socket, "comm_msg", {"comm_id": comm_id, "data": {"value": 42}})
    texts: dict[str, str] = {}
    while True:
        msg = kc.get_iopub_msg(timeout=TIMEOUT)
        validate(msg)
        parent = msg["parent_header"].get("msg_id")
        if msg["msg_type"] == "stream":
            texts[parent] = texts.get(parent, "") + msg["content"]["text"]
        if msg["msg_type"] == "status" and parent == waiting and msg["content"]["execution_state"] == "idle":
            break
    assert texts == {sent["header"]["msg_id"]: "handled\n", waiting: "got {'value': 42}\n"}
    reply = kc.get_shell_msg(timeout=TIMEOUT)
    validate(reply)
    assert reply["parent_header"]["msg_id"] == waiting and reply["content"]["status"] == "ok"


def test_the_sandbox_looks_like_an_ipykernel_to_libraries_and_loads_it_on_use(kc: BlockingKernelClient) -> None:
    """ipykernel's modules are stand-ins until used (runner.defer_import): libraries that ask
    whether they run in a kernel get yes, code that uses ipykernel gets the real modules."""
    probe = run(kc, "import sys\n"
                    "before = type(sys.modules['ipykernel.zmqshell']).__name__\n"
                    "from tqdm.auto import tqdm\n"
                    "import ipykernel.zmqshell\n"
                    "before, tqdm.__mro__[1].__module__, ipykernel.zmqshell.ZMQInteractiveShell.__module__, "
                    "type(sys.modules['ipykernel.zmqshell']).__name__")
    assert probe.of_type("execute_result")[0]["data"]["text/plain"] == \
        "('StandIn', 'tqdm.notebook', 'ipykernel.zmqshell', 'module')"  # tqdm.auto's bar is built on the widget one


def test_usage_reply_takes_only_sane_numbers_from_the_sandbox() -> None:
    from sandbox_kernel.kernel.usage import usage_reply

    sample = {"hostname": "sb", "pid": 7, "kernel_cpu": float("nan"), "kernel_memory": "lots", "cpu_count": True,
              "meminfo": {"total": 8 * 2**30, "available": 6 * 2**30, "active": 2**30, "inactive": -1},
              "sandbox_processes_memory": 2**29}
    assert usage_reply(sample, 2**30) == {
        "hostname": "sb", "pid": 7, "kernel_cpu": None, "kernel_memory": None, "cpu_count": None,
        "host_cpu_percent": None, "host_virtual_memory": {
            "total": 2**30, "available": 2**29, "used": 2**29, "free": 2**29, "percent": 50.0,
            # the machine's LRU counts say nothing of a sandbox smaller than the machine
            "active": None, "inactive": None}}
    # A sandbox that is the whole machine (a micro-VM): its own meminfo.
    whole = usage_reply(sample, 16 * 2**30)["host_virtual_memory"]
    assert (whole["used"], whole["active"], whole["inactive"]) == (2 * 2**30, 2**30, None)
