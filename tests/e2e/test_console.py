"""`jupyter console --kernel <sandbox kernel>` runs cells (driven through a pty with pexpect)
and asks the kernel whether input is complete; the kernel answers history requests."""

from __future__ import annotations

import io
import os
import re
import sys
from typing import Any

import pexpect
import pytest
from jupyter_client.blocking.client import BlockingKernelClient

from kernel_helpers import TIMEOUT, execute, running_kernel

pytestmark = [pytest.mark.slow, pytest.mark.one_path]

ANSI_CONTROL = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def test_jupyter_console_runs_cells(kernelspec: str) -> None:
    """The full prompt_toolkit console in a pty: Enter on an incomplete line asks the kernel
    (is_complete_request) and continues with the indent it answered."""
    screen = io.StringIO()
    env = {**os.environ, "TERM": "xterm", "PROMPT_TOOLKIT_NO_CPR": "1"}
    console = pexpect.spawn(sys.executable, ["-m", "jupyter_console", "--kernel", kernelspec,
                                             "--ZMQTerminalInteractiveShell.kernel_timeout=120"],
                            env=env, encoding="utf-8", timeout=TIMEOUT, dimensions=(40, 200))
    console.logfile_read = screen
    try:
        prompt(console, 1)
        console.send("import os; x = 6 * 7; print(os.getcwd())\r")
        console.expect_exact("/workspace")  # the sandbox's working directory, not ours
        prompt(console, 2)
        console.send("x\r")
        console.expect(r"Out\[.*2.*\]: .*42")
        prompt(console, 3)
        console.send("for i in range(3):\r")
        console.expect_exact("...: ")  # incomplete: a continuation line
        console.send("print('line', i * x)\r")  # no indent typed: the kernel's indent is used
        console.expect_exact("...: ")
        console.send("\r")
        console.expect_exact("line 84")
        prompt(console, 4)
        console.send("%sandbox status\r")
        console.expect(r"state\s+running")
        prompt(console, 5)
        # exit in the sandbox asks the frontend to end (an ask_exit payload): the console
        # quits and shuts the kernel down, as with ipykernel.
        console.send("exit\r")
        console.expect(pexpect.EOF)
    finally:
        console.close(force=True)
    text = ANSI_CONTROL.sub("", screen.getvalue())
    assert "    print('line', i * x)" in text
    assert "did not respond to an is_complete_request" not in text
    assert console.exitstatus == 0


def prompt(console: pexpect.spawn, number: int) -> None:
    """Wait for the In [number] prompt (prompt_toolkit colours the number)."""
    console.expect(rf"In \[\S*{number}\S*\]: ")


def test_is_complete_and_history(kernelspec: str) -> None:
    with running_kernel(kernelspec) as (_, kc):
        assert reply(kc, kc.is_complete("x = 1")) == {"status": "complete"}
        assert reply(kc, kc.is_complete("def f():")) == {"status": "incomplete", "indent": "    "}
        assert reply(kc, kc.is_complete("x = )"))["status"] == "invalid"
        execute(kc, "a = 'first'")
        execute(kc, "%sandbox status")
        kc.execute("b = 'silent'", silent=True)  # silent cells are not history
        execute(kc, "a * 2")
        tail = reply(kc, kc.history(hist_access_type="tail", n=3))["history"]
        [(session, _, _), *_] = tail
        assert [(line, source) for _, line, source in tail] == [
            (1, "a = 'first'"), (2, "%sandbox status"), (3, "a * 2")]
        found = reply(kc, kc.history(hist_access_type="search", pattern="a *"))["history"]
        assert [source for _, _, source in found][-1] == "a * 2"
        with_output = reply(kc, kc.history(hist_access_type="range", session=0, start=2, stop=3,
                                           output=True))["history"]
        assert with_output == [[session, 2, ["%sandbox status", None]]]
    # A new kernel is a new history session; the previous one is still there.
    with running_kernel(kernelspec) as (_, kc):
        previous = reply(kc, kc.history(hist_access_type="range", session=-1, start=1))["history"]
        assert [source for _, _, source in previous] == ["a = 'first'", "%sandbox status", "a * 2"]
        assert all(s == session for s, _, _ in previous)


def reply(kc: BlockingKernelClient, msg_id: str) -> dict[str, Any]:
    """The shell reply to msg_id."""
    while True:
        msg = kc.get_shell_msg(timeout=TIMEOUT)
        if msg["parent_header"].get("msg_id") == msg_id:
            return msg["content"]
