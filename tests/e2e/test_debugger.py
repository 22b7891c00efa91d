"""The debugger, end to end: DAP requests from jupyter_client on the control channel, served by
debugpy inside the sandbox (guest/runner/debug.py), events back on IOPub; every message validated.
"""

from __future__ import annotations

import itertools
import queue
import time
from typing import Any

import pytest
from jupyter_client.blocking.client import BlockingKernelClient
from jupyter_client.manager import start_new_kernel

from engine_helpers import sandbox_status
from fault_proxy import proxied_engine
from kernel_helpers import TIMEOUT, execute, running_kernel
from sandbox_kernel.guest.runner import debug as runner_debug
from sandbox_kernel.api import SandboxStatus
from sandbox_kernel.local.service import EngineEndpoint
from message_spec import validate


CELL = ("def add(a, b):\n"
        "    total = a + b\n"
        "    return total\n"
        "\n"
        "result = add(2, 3)\n")
BREAKPOINT_LINE = 2
_seqs = itertools.count(1)


def dap(kc: BlockingKernelClient, command: str, arguments: dict[str, Any] | None = None) -> dict[str, Any]:
    """One debug_request on the control channel; its debug_reply's content (validated)."""
    request = {"type": "request", "seq": next(_seqs), "command": command, "arguments": arguments or {}}
    msg = kc.session.msg("debug_request", request)
    kc.control_channel.send(msg)
    while True:
        reply = kc.control_channel.get_msg(timeout=TIMEOUT)
        if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
            break
    validate(reply)
    assert reply["msg_type"] == "debug_reply"
    assert reply["content"]["request_seq"] == request["seq"] and reply["content"]["command"] == command
    return reply["content"]


def next_debug_event(kc: BlockingKernelClient, event: str) -> dict[str, Any]:
    """The next debug_event of that kind on IOPub (others, and other messages, skipped)."""
    while True:
        try:
            msg = kc.get_iopub_msg(timeout=TIMEOUT)
        except queue.Empty:
            raise AssertionError(f"no {event} debug_event") from None
        validate(msg)
        assert msg["msg_type"] != "stream", f"debugging printed something: {msg['content']}"
        if msg["msg_type"] == "debug_event" and msg["content"]["event"] == event:
            return msg["content"]


def shell_reply(kc: BlockingKernelClient, msg_id: str) -> dict[str, Any]:
    """The shell channel's reply to that request (validated; replies to earlier ones skipped)."""
    while True:
        reply = kc.get_shell_msg(timeout=TIMEOUT)
        validate(reply)
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply


def start_debugging(kc: BlockingKernelClient) -> None:
    """What JupyterLab does when the debugger is switched on."""
    initialized = dap(kc, "initialize", {"clientID": "test", "clientName": "test", "adapterID": "python",
                                         "pathFormat": "path", "linesStartAt1": True, "columnsStartAt1": True,
                                         "supportsVariableType": True, "supportsVariablePaging": True})
    assert initialized["success"], initialized.get("message")
    attached = dap(kc, "attach", {})
    assert attached["success"], attached


@pytest.fixture(scope="module")
def debugging(kc: BlockingKernelClient) -> BlockingKernelClient:
    """The module's kernel, its debugger switched on (and configured: configurationDone)."""
    start_debugging(kc)
    return kc


@pytest.mark.parametrize("code", ["", "a", "ab", "abc", "abcd", "x = 1\nprint(x)\n", "caf\u00e9 \u2713 \U0001f600"])
def test_cells_are_named_by_the_hash_frontends_compute(code: str) -> None:
    """JupyterLab finds a cell's file by Murmur2 of its code, as ipykernel names it."""
    from ipykernel.compiler import murmur2_x86

    assert runner_debug.murmur2(code.encode("utf-8"), runner_debug.HASH_SEED) == \
        murmur2_x86(code, runner_debug.HASH_SEED)


@pytest.mark.slow
def test_kernel_info_advertises_the_debugger(kc: BlockingKernelClient) -> None:
    info = kc.kernel_info(reply=True, timeout=TIMEOUT)
    validate(info)
    assert "debugger" in info["content"]["supported_features"]
    assert info["content"]["debugger"] is True


@pytest.mark.slow
def test_a_breakpoint_in_a_cell_stops_it_with_its_locals(debugging: BlockingKernelClient) -> None:
    kc = debugging
    info = dap(kc, "debugInfo")
    assert info["success"] and info["body"]["isStarted"]
    assert info["body"]["hashMethod"] == "Murmur2" and info["body"]["tmpFileSuffix"] == ".py"
    dumped = dap(kc, "dumpCell", {"code": CELL})
    source = dumped["body"]["sourcePath"]
    assert source.startswith(info["body"]["tmpFilePrefix"]) and source.endswith(".py")
    points = dap(kc, "setBreakpoints", {"source": {"path": source}, "breakpoints": [{"line": BREAKPOINT_LINE}],
                                        "sourceModified": False})
    assert points["success"] and points["body"]["breakpoints"][0]["verified"], points
    assert dap(kc, "configurationDone")["success"]
    assert dap(kc, "debugInfo")["body"]["breakpoints"] == [{"source": source,
                                                             "breakpoints": [{"line": BREAKPOINT_LINE}]}]

    msg_id = kc.execute(CELL)
    stopped = next_debug_event(kc, "stopped")
    thread = stopped["body"]["threadId"]
    assert dap(kc, "debugInfo")["body"]["stoppedThreads"] == [thread]
    frames = dap(kc, "stackTrace", {"threadId": thread})["body"]["stackFrames"]
    assert (frames[0]["name"], frames[0]["line"], frames[0]["source"]["path"]) == ("add", BREAKPOINT_LINE, source)
    # Just my code: the cell's frames only, never the runner's or IPython's.
    assert all(frame["source"]["path"] == source for frame in frames), frames
    scopes = dap(kc, "scopes", {"frameId": frames[0]["id"]})["body"]["scopes"]
    local_scope = next(scope for scope in scopes if scope["name"] == "Locals")
    variables = dap(kc, "variables", {"variablesReference": local_scope["variablesReference"]})
    values = {variable["name"]: variable["value"] for variable in variables["body"]["variables"]}
    assert (values["a"], values["b"]) == ("2", "3")

    assert dap(kc, "continue", {"threadId": thread})["success"]
    assert shell_reply(kc, msg_id)["content"]["status"] == "ok"
    assert execute(kc, "result").of_type("execute_result")[0]["data"]["text/plain"] == "5"


@pytest.mark.slow
def test_inspect_variables_lists_the_users_globals(kc: BlockingKernelClient) -> None:
    execute(kc, "answer = 42\ngreeting = 'hello'")
    listed = dap(kc, "inspectVariables")
    assert listed["success"]
    variables = {variable["name"]: variable for variable in listed["body"]["variables"]}
    assert variables["answer"]["value"] == "42" and variables["answer"]["type"] == "int"
    assert variables["greeting"]["value"] == "'hello'"
    assert not {"In", "Out", "get_ipython", "_i1"} & set(variables), "IPython's own names are hidden"
    rich = dap(kc, "richInspectVariables", {"variableName": "answer"})
    assert rich["success"] and rich["body"]["data"]["text/plain"] == "42"


def stop_at_breakpoint(kc: BlockingKernelClient, code: str, line: int) -> tuple[str, int]:
    """Run code with a breakpoint at line; the execute request's id and the stopped thread."""
    source = dap(kc, "dumpCell", {"code": code})["body"]["sourcePath"]
    assert dap(kc, "setBreakpoints", {"source": {"path": source}, "breakpoints": [{"line": line}]})["success"]
    msg_id = kc.execute(code)
    return msg_id, next_debug_event(kc, "stopped")["body"]["threadId"]


@pytest.mark.slow
def test_an_interrupt_ends_a_cell_stopped_at_a_breakpoint(debugging: BlockingKernelClient) -> None:
    kc = debugging
    code = "stuck = 1\nstuck += 1\n"
    msg_id, _ = stop_at_breakpoint(kc, code, 2)
    interrupted = kc.session.msg("interrupt_request", {})
    kc.control_channel.send(interrupted)
    reply = shell_reply(kc, msg_id)
    assert (reply["content"]["status"], reply["content"]["ename"]) == ("error", "KeyboardInterrupt")
    assert dap(kc, "debugInfo")["body"]["stoppedThreads"] == []
    # The debugger still works: the same breakpoint stops the cell again.
    msg_id, thread = stop_at_breakpoint(kc, code, 2)
    assert dap(kc, "continue", {"threadId": thread})["success"]
    assert shell_reply(kc, msg_id)["content"]["status"] == "ok"


@pytest.mark.slow
def test_the_debugger_switched_off_leaves_cells_alone_and_can_be_switched_on_again(
        debugging: BlockingKernelClient) -> None:
    kc = debugging
    source = dap(kc, "dumpCell", {"code": CELL})["body"]["sourcePath"]
    assert dap(kc, "setBreakpoints", {"source": {"path": source}, "breakpoints": [{"line": BREAKPOINT_LINE}]})["success"]
    assert dap(kc, "disconnect", {"restart": False, "terminateDebuggee": True})["success"]
    assert dap(kc, "debugInfo")["body"]["isStarted"] is False
    # The breakpoint is gone with the debugger: the cell runs through (and the runner lives).
    assert execute(kc, CELL + "result").of_type("execute_result")[0]["data"]["text/plain"] == "5"
    start_debugging(kc)
    msg_id, thread = stop_at_breakpoint(kc, CELL, BREAKPOINT_LINE)
    assert dap(kc, "continue", {"threadId": thread})["success"]
    assert shell_reply(kc, msg_id)["content"]["status"] == "ok"


@pytest.mark.slow
def test_the_runner_dying_while_stopped_is_the_kernel_dying(kernelspec: str) -> None:
    with running_kernel(kernelspec) as (km, kc):
        start_debugging(kc)
        msg_id, thread = stop_at_breakpoint(kc, CELL, BREAKPOINT_LINE)
        frame = dap(kc, "stackTrace", {"threadId": thread})["body"]["stackFrames"][0]["id"]
        # Code evaluated in the stopped frame kills the runner (as a cell could).
        killed = dap(kc, "evaluate", {"expression": "__import__('os').kill(__import__('os').getpid(), 9)",
                                      "frameId": frame, "context": "repl"})
        assert not killed["success"] and killed["message"]
        # As a kernel whose Python dies (tests/e2e/test_runner_death.py): the cell says why, and
        # the kernel process ends, so that the frontend restarts it.
        said = ""
        while "died" not in said:
            msg = kc.get_iopub_msg(timeout=TIMEOUT)
            if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
                said += msg["content"]["text"]
        assert "the Python in the sandbox died (killed by SIGKILL)" in said
        deadline = time.monotonic() + TIMEOUT
        while km.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not km.is_alive()


@pytest.mark.slow
def test_restart_and_shutdown_while_stopped(kernelspec: str, engine: EngineEndpoint) -> None:
    km, kc = start_new_kernel(kernel_name=kernelspec, startup_timeout=TIMEOUT)
    try:
        start_debugging(kc)
        stop_at_breakpoint(kc, CELL, BREAKPOINT_LINE)
        km.restart_kernel()
        kc.wait_for_ready(timeout=TIMEOUT)
        assert execute(kc, "1 + 1").of_type("execute_result")[0]["data"]["text/plain"] == "2"
        sandbox_id = execute(kc, "import os; print(os.environ['SANDBOX_ID'])").text().strip()
        start_debugging(kc)
        stop_at_breakpoint(kc, CELL, BREAKPOINT_LINE)
    finally:
        kc.stop_channels()
        km.shutdown_kernel()  # a shutdown_request, answered, then the process ends
    assert not km.is_alive()
    assert sandbox_status(engine, sandbox_id) in (SandboxStatus.DESTROYED, None)


@pytest.mark.slow
def test_no_debugger_is_advertised_where_the_sandbox_has_none(kernelspec: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A rootfs with a bare Python (no IPython, no debugpy): requests are refused, not left to time out."""
    monkeypatch.setenv("SANDBOX_KERNEL_ROOTFS", "python-stdlib")
    with running_kernel(kernelspec) as (_, kc):
        info = kc.kernel_info(reply=True, timeout=TIMEOUT)["content"]
        assert info["supported_features"] == [] and info["debugger"] is False
        refused = dap(kc, "initialize", {"adapterID": "python"})
        assert refused["success"] is False and "no debugger" in refused["message"]


@pytest.mark.slow
def test_no_debugger_is_advertised_without_a_channel(kernelspec: str, engine: EngineEndpoint,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A provider without managed processes (one exec per cell): no channel carries the
    debugger's events, so there is none, although the sandbox has debugpy."""
    with proxied_engine(engine, monkeypatch, refuse_processes=True), running_kernel(kernelspec) as (_, kc):
        assert execute(kc, "1").reply["content"]["status"] == "ok"
        info = kc.kernel_info(reply=True, timeout=TIMEOUT)["content"]
        assert info["supported_features"] == [] and info["debugger"] is False
        assert dap(kc, "initialize", {"adapterID": "python"})["success"] is False
