"""The Jupyter messaging protocol, end to end: jupyter_client -> installed kernelspec ->
SandboxKernel -> local engine -> bwrap sandbox -> runner, and back.
"""

from __future__ import annotations

import base64
import platform

import pytest
from jupyter_client.blocking.client import BlockingKernelClient
from jupyter_client.manager import KernelManager

from kernel_helpers import PROVIDER, TIMEOUT, execute, plain_traceback

pytestmark = pytest.mark.slow


def test_first_cell_shows_only_its_own_output(kc: BlockingKernelClient) -> None:
    first = execute(kc, "1")
    assert [m["msg_type"] for m in first.messages if m["msg_type"] not in ("status", "execute_input")] == \
        ["execute_result"], "the kernel adds no line of its own to the first cell"
    # Where it runs is in the banner instead.
    banner = kc.kernel_info(reply=True, timeout=TIMEOUT)["content"]["banner"]
    assert f"ready on {PROVIDER}" in banner and "Sandbox sb-" in banner


def test_kernel_info_reports_the_sandbox_python(kc: BlockingKernelClient) -> None:
    info = kc.kernel_info(reply=True, timeout=TIMEOUT)["content"]
    assert info["implementation"] == "sandbox-kernel"
    assert info["language_info"]["name"] == "python"
    # The local engine's sandboxes run the engine's interpreter (mounted read-only).
    assert info["language_info"]["version"] == platform.python_version()


def test_state_persists_and_execute_result_counts(kc: BlockingKernelClient) -> None:
    execute(kc, "x = 41")
    result = execute(kc, "x + 1")
    [content] = result.of_type("execute_result")
    assert content["data"]["text/plain"] == "42"
    assert content["execution_count"] == result.reply["content"]["execution_count"]
    inputs = [m["content"] for m in result.messages if m["msg_type"] == "execute_input"]
    assert inputs[0]["execution_count"] == content["execution_count"]
    assert execute(kc, "x = 5;").of_type("execute_result") == []
    assert execute(kc, "x;").of_type("execute_result") == []


def test_stream_text_arrives_complete_and_in_order(kc: BlockingKernelClient) -> None:
    code = ("import sys\n"
            "for i in range(3):\n"
            "    print('out', i, flush=True)\n"
            "    print('err', i, file=sys.stderr, flush=True)\n")
    result = execute(kc, code)
    merged: list[tuple[str, str]] = []
    for msg in result.outputs:
        name, text = msg["content"]["name"], msg["content"]["text"]
        if merged and merged[-1][0] == name:
            merged[-1] = (name, merged[-1][1] + text)
        else:
            merged.append((name, text))
    assert merged == [("stdout", "out 0\n"), ("stderr", "err 0\n"), ("stdout", "out 1\n"),
                      ("stderr", "err 1\n"), ("stdout", "out 2\n"), ("stderr", "err 2\n")]


def test_output_of_subprocesses_and_file_descriptors(kc: BlockingKernelClient) -> None:
    result = execute(kc, "import os\nos.write(1, b'raw fd\\n')\n!echo from a shell")
    # IPython runs !cmd in a pseudo-terminal (as under ipykernel), hence its \r\n.
    assert result.text() == "raw fd\nfrom a shell\r\n"


def test_rich_display_update_and_clear(kc: BlockingKernelClient) -> None:
    html = execute(kc, "from IPython.display import HTML, display\ndisplay(HTML('<b>bold</b>'))")
    [shown] = html.of_type("display_data")
    assert shown["data"]["text/html"] == "<b>bold</b>"

    updated = execute(kc, "h = display('first', display_id='slot')\nh.update('second')")
    [first] = updated.of_type("display_data")
    [second] = updated.of_type("update_display_data")
    assert first["transient"] == {"display_id": "slot"} == second["transient"]
    assert (first["data"]["text/plain"], second["data"]["text/plain"]) == ("'first'", "'second'")

    cleared = execute(kc, "from IPython.display import clear_output\nprint('a')\nclear_output(wait=True)\nprint('b')")
    kinds = [(m["msg_type"], m["content"].get("text", m["content"].get("wait"))) for m in cleared.outputs]
    assert kinds == [("stream", "a\n"), ("clear_output", True), ("stream", "b\n")]


def test_repr_html_object_as_execute_result(kc: BlockingKernelClient) -> None:
    code = ("class Table:\n"
            "    def _repr_html_(self):\n"
            "        return '<table><tr><td>1</td></tr></table>'\n"
            "Table()")
    [result] = execute(kc, code).of_type("execute_result")
    assert result["data"]["text/html"] == "<table><tr><td>1</td></tr></table>"
    assert result["data"]["text/plain"].startswith("<__main__.Table at 0x")  # IPython's pretty repr


def test_matplotlib_figure_is_an_inline_png(kc: BlockingKernelClient) -> None:
    code = "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.title('t');"
    pngs = [d["data"]["image/png"] for d in execute(kc, code).of_type("display_data") if "image/png" in d["data"]]
    assert len(pngs) == 1
    assert base64.b64decode(pngs[0]).startswith(b"\x89PNG\r\n\x1a\n")


def test_error_points_at_the_users_cell(kc: BlockingKernelClient) -> None:
    result = execute(kc, "def f():\n    return 1 / 0\nf()")
    [error] = result.of_type("error")
    assert (error["ename"], error["evalue"]) == ("ZeroDivisionError", "division by zero")
    reply = result.reply["content"]
    assert reply["status"] == "error"
    assert (reply["ename"], reply["evalue"], reply["traceback"]) == (
        error["ename"], error["evalue"], error["traceback"])
    text = plain_traceback(error["traceback"])
    assert "return 1 / 0" in text and "f()" in text
    assert "sandbox_kernel" not in text  # no frame of the runner's (sandbox_kernel_guest) nor the kernel's
    assert any("\x1b[" in line for line in error["traceback"]), "tracebacks are coloured"
    assert execute(kc, "print('still alive')").text() == "still alive\n"


def test_exit_asks_the_frontend_to_close_and_the_runner_stays(kc: BlockingKernelClient) -> None:
    execute(kc, "kept_through_exit = 1")
    reply = execute(kc, "exit()").reply["content"]
    assert reply["status"] == "ok"
    assert reply["payload"] == [{"source": "ask_exit", "keepkernel": False}]
    # A frontend that does not close (a notebook) goes on with the same runner.
    assert execute(kc, "print(kept_through_exit)").text() == "1\n"


def test_syntax_error(kc: BlockingKernelClient) -> None:
    [error] = execute(kc, "def broken(:\n    pass").of_type("error")
    assert error["ename"] == "SyntaxError"


def test_interrupt_stops_a_busy_loop(kernel: tuple[KernelManager, BlockingKernelClient]) -> None:
    km, kc = kernel
    execute(kc, "before_interrupt = 'kept'")
    msg_id = kc.execute("print('looping', flush=True)\nwhile True:\n    pass")
    # Interrupt once the loop really runs: its first line has reached the frontend.
    while True:
        msg = kc.get_iopub_msg(timeout=TIMEOUT)
        if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
            break
    km.interrupt_kernel()
    reply = kc.get_shell_msg(timeout=TIMEOUT)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = kc.get_shell_msg(timeout=TIMEOUT)
    assert reply["content"]["status"] == "error"
    assert reply["content"]["ename"] == "KeyboardInterrupt"
    after = execute(kc, "print(before_interrupt)")
    assert after.text() == "kept\n", (after.reply["content"], after.messages)  # failed once under load: say how


def test_a_failed_cell_aborts_the_cells_queued_behind_it_and_no_later_one(kc: BlockingKernelClient) -> None:
    """stop_on_error as in ipykernel: execute_requests sent before the failed cell's reply are
    aborted (whatever their own stop_on_error); one sent on that reply runs, every time."""
    for _ in range(5):
        failing = kc.execute("import time; time.sleep(0.3); 1/0")
        queued = [kc.execute("queued = 1"), kc.execute("queued = 2", stop_on_error=False)]
        replies = {}
        while len(replies) < 3:
            reply = kc.get_shell_msg(timeout=TIMEOUT)
            if reply["msg_type"] == "execute_reply":  # not a kernel_info_reply left from the start
                replies[reply["parent_header"]["msg_id"]] = reply["content"]["status"]
        assert [replies[msg_id] for msg_id in [failing, *queued]] == ["error", "aborted", "aborted"]
        for _ in range(3):  # sent right after an error reply: never caught by its abort
            assert execute(kc, "1/0").reply["content"]["status"] == "error"
            assert execute(kc, "print('runs')").text() == "runs\n"
    assert execute(kc, "print('queued' in globals())").text() == "False\n"


def test_input_and_getpass_use_the_stdin_channel(kc: BlockingKernelClient) -> None:
    prompts: list[dict] = []

    def answer(msg: dict) -> None:
        prompts.append(msg["content"])
        kc.input("secret" if msg["content"]["password"] else "world")

    result = execute(kc, "name = input('Who? ')\nprint('hello', name)", allow_stdin=True, stdin_hook=answer)
    assert result.text() == "hello world\n"
    hidden = execute(kc, "import getpass\npw = getpass.getpass('Password: ')\nprint(len(pw))",
                     allow_stdin=True, stdin_hook=answer)
    assert hidden.text() == "6\n"
    assert prompts == [{"prompt": "Who? ", "password": False}, {"prompt": "Password: ", "password": True}]


def test_input_without_stdin_fails_cleanly(kc: BlockingKernelClient) -> None:
    result = execute(kc, "input('nobody will answer: ')", allow_stdin=False)
    assert result.reply["content"]["status"] == "error"
    [error] = result.of_type("error")
    assert error["ename"] == "StdinNotImplementedError"  # as ipykernel raises
    assert "sandbox_kernel" not in plain_traceback(error["traceback"])  # no frame of the runner's
    assert execute(kc, "print('fine')").text() == "fine\n"


def test_complete_and_inspect_run_in_the_sandbox(kc: BlockingKernelClient) -> None:
    execute(kc, "sandbox_only_variable = 3")
    code = "sandbox_only_v"
    reply = kc.complete(code, len(code), reply=True, timeout=TIMEOUT)["content"]
    assert reply["status"] == "ok"
    assert "sandbox_only_variable" in reply["matches"]
    assert (reply["cursor_start"], reply["cursor_end"]) == (0, len(code))
    inspected = kc.inspect("sandbox_only_variable", 5, reply=True, timeout=TIMEOUT)["content"]
    assert inspected["found"] is True
    assert "int" in inspected["data"]["text/plain"]


@pytest.mark.parametrize(("code", "status", "indent"), [
    ("x = 1", "complete", None),
    ("for i in range(3):", "incomplete", "    "),
    ("x = (1,", "incomplete", ""),
    ("1 +* 2", "invalid", None),
])
def test_is_complete_on_the_host(kc: BlockingKernelClient, code: str, status: str, indent: str | None) -> None:
    msg_id = kc.is_complete(code)
    reply = kc.get_shell_msg(timeout=TIMEOUT)
    assert reply["parent_header"]["msg_id"] == msg_id
    assert reply["content"]["status"] == status
    if indent is not None:
        assert reply["content"]["indent"] == indent

