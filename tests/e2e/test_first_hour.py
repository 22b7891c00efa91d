"""What a new user met in the first hour (issue 17), each checked headless: HTML without
LaTeX, progress lines that finish in a terminal, fork's result last, magic arguments
checked and expanded, one clear line for start-up errors, the CLI's checks and summary."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import nbformat
import pexpect
import pytest

from kernel_helpers import TIMEOUT, VIA_CREATEOS, execute, running_kernel
from test_console import ANSI_CONTROL, prompt

pytestmark = pytest.mark.slow


def displays(result: Any) -> list[tuple[str, str, str]]:
    """(msg_type, display id, text) of each display message of a cell."""
    return [(m["msg_type"], m["content"].get("transient", {}).get("display_id", ""),
             m["content"]["data"].get("text/plain", "")) for m in result.messages
            if m["msg_type"] in ("display_data", "update_display_data")]


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sandbox_kernel", *args], capture_output=True,
                          text=True, timeout=300, env=env)


def test_notebook_habits_in_one_kernel(kernelspec: str) -> None:
    with running_kernel(kernelspec) as (_, kc):
        me = execute(kc, "import os; me = os.environ['SANDBOX_ID']; print(me)").text().strip()

        # JupyterLab renders $…$ in HTML as math unless told not to (the browser test looks)
        [cost] = execute(kc, "%sandbox cost").of_type("display_data")
        assert "$0.03616363/vCPU-h" in cost["data"]["text/plain"]
        assert cost["data"]["text/html"].startswith('<div class="tex2jax_ignore mathjax_ignore"><table>')

        # prose is not a rule; the rules stay as they were
        bad = execute(kc, "%egress allow not a rule")
        assert bad.reply["content"]["status"] == "error"
        assert bad.text("stderr") == ("sandbox-kernel: %egress: 'not' 'a' 'rule' is not a rule: give a full "
                                      "host name (example.com), host:port, an IP address or a CIDR\n")
        assert "all public destinations" in execute(kc, "%egress").of_type("display_data")[0]["data"]["text/plain"]
        assert "egress: only db:5432, localhost" in execute(kc, "%egress allow db:5432 localhost").text()

        # {var} and $var are the notebook's variables, as in IPython's magics
        for line in ("%sandbox attach {me}", "%sandbox attach $me", "%sandbox attach {me.strip()}"):
            said = execute(kc, line).text("stderr")
            assert said == f"sandbox-kernel: %sandbox attach: this notebook already drives {me}\n", said

        # fork: the result is the last thing shown, on the line that said it paused first
        fork = execute(kc, "%sandbox fork")
        shown = displays(fork)
        assert any("first: only a paused sandbox can be forked" in text for _, _, text in shown)
        assert shown[-1][2].startswith(f"Forked {me} into sb-") and shown[-1][2].endswith(f"{me} was paused first")
        assert len({display_id for _, display_id, _ in shown}) == 1
        child = shown[-1][2].split(" into ")[1].split()[0]
        assert execute(kc, "print('resumed')").text() == "resumed\n"
        back = execute(kc, f"%sandbox attach {child} --destroy-previous\n%sandbox on-shutdown destroy")
        assert back.reply["content"]["status"] == "ok", back.outputs


def test_progress_lines_finish_in_a_terminal_frontend(kernelspec: str) -> None:
    """A client that asks is_complete (a terminal) gets each outcome as a line of its own;
    jupyter console ignores update_display_data."""
    with running_kernel(kernelspec) as (_, kc):
        execute(kc, "1")
        kc.is_complete("%sandbox pause")
        kc.get_shell_msg(timeout=TIMEOUT)
        paused = displays(execute(kc, "%sandbox pause"))
        assert [kind for kind, _, _ in paused] == ["display_data", "display_data"]
        assert paused[0][2].startswith("Pausing sandbox ") and " paused (" in paused[1][2]
        resumed = displays(execute(kc, "print(1)"))
        assert [kind for kind, _, _ in resumed] == ["display_data", "display_data"]
        assert "was paused: resuming…" in resumed[0][2]
        assert resumed[1][2].startswith("resumed in "), "the headline is not printed twice"


def test_jupyter_console_shows_outcomes_and_no_debugger_warnings(kernelspec: str, tmp_path: Path) -> None:
    screen = tmp_path / "screen.txt"
    env = {**os.environ, "TERM": "xterm", "PROMPT_TOOLKIT_NO_CPR": "1"}
    console = pexpect.spawn(sys.executable, ["-m", "jupyter_console", "--kernel", kernelspec,
                                             "--ZMQTerminalInteractiveShell.kernel_timeout=120"],
                            env=env, encoding="utf-8", timeout=TIMEOUT, dimensions=(40, 200))
    console.logfile_read = screen.open("w")
    try:
        prompt(console, 1)
        console.send("%sandbox pause\r")
        console.expect(r"Sandbox sb-\w+ paused \(")
        prompt(console, 2)
        console.send("print('after')\r")
        console.expect(r"resumed in [0-9.]+ s")
        console.expect_exact("after")
        prompt(console, 3)
        console.send("%sandbox pause\r")
        console.expect(r"Sandbox sb-\w+ paused \(")
        prompt(console, 4)
        console.send("exit\r")  # ends the session without resuming the sandbox to run `exit`
        console.expect(pexpect.EOF)
    finally:
        console.close(force=True)
        console.logfile_read.close()
    text = ANSI_CONTROL.sub("", screen.read_text())
    assert "frozen modules" not in text and "Debugger warning" not in text, text
    assert text.count("was paused: resuming") == 1, text


@pytest.mark.skipif(VIA_CREATEOS, reason="starts its own misconfigured kernels")
def test_start_errors_are_one_line(kernelspec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDBOX_KERNEL_SHAPE", "s-99vcpu")
    with running_kernel(kernelspec) as (_, kc):
        first = execute(kc, "1")
        assert not displays(first)  # no 'Starting a sandbox on an unconfigured provider…'
        assert first.text("stderr") == ("sandbox-kernel: SANDBOX_KERNEL_SHAPE must be a shape id like "
                                        "s-1vcpu-1gb or s-2vcpu-4gb, not 's-99vcpu'\n")
    monkeypatch.delenv("SANDBOX_KERNEL_SHAPE")
    url = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("CREATEOS_SANDBOX_API_KEY", "sk-first-hour-test")
    monkeypatch.setenv("CREATEOS_SANDBOX_BASE_URL", url)
    with running_kernel(kernelspec) as (_, kc):
        failed = execute(kc, "1")
        # Refused at once: no progress line (that is for a slow start), one line saying why.
        assert not displays(failed)
        said = failed.text("stderr")
        assert said.startswith("sandbox-kernel: could not start a sandbox on CreateOS: cannot reach the "
                               f"sandbox server: {url} (ConnectError"), said
        assert "sk-first-hour-test" not in said


def test_doctor_tries_the_base_url_and_install_checks_the_shape(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    env = {**os.environ, "CREATEOS_SANDBOX_API_KEY": "sk-first-hour-test", "CREATEOS_SANDBOX_BASE_URL": url}
    doctor = cli("doctor", env=env)
    assert doctor.returncode == 1
    assert f"  ✗ {url}: cannot reach the sandbox server: {url} (ConnectError" in doctor.stdout, doctor.stdout
    assert "sk-first-hour-test" not in doctor.stdout + doctor.stderr

    for shape, why in (("s-99vcpu", "--shape must be a shape id like s-1vcpu-1gb"),
                       ("s-9vcpu-1gb", "--shape: no shape 's-9vcpu-1gb' (known: s-1vcpu-256mb")):
        refused = cli("install", "--prefix", str(tmp_path), "--shape", shape)
        assert refused.returncode == 1 and why in refused.stderr, refused.stderr
    assert not (tmp_path / "share").exists()
    ok = cli("install", "--prefix", str(tmp_path), "--shape", "s-2vcpu-4gb")
    assert ok.returncode == 0, ok.stderr
    spec = json.loads((tmp_path / "share/jupyter/kernels/sandbox/kernel.json").read_text())
    assert spec["argv"][1] == "-Xfrozen_modules=off"  # as ipykernel's: no debugger warnings


def test_run_sums_up(kernelspec: str, tmp_path: Path) -> None:
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("print('one')"),
        nbformat.v4.new_code_cell("1 / 0"),
        nbformat.v4.new_markdown_cell("text"),
        nbformat.v4.new_code_cell("print('three')"),
    ])
    path = tmp_path / "errors.ipynb"
    nbformat.write(nb, path)
    stops = cli("run", str(path), "--kernel", kernelspec)
    assert stops.returncode == 1
    last = stops.stdout.strip().splitlines()[-1]
    assert last.startswith("ran 2 of 3 code cells in ") and last.endswith("; failed: In [2] (ZeroDivisionError)")
    assert "\nthree\n" not in stops.stdout  # not run (its source is printed)
    goes_on = cli("run", str(path), "--kernel", kernelspec, "--allow-errors")
    assert goes_on.returncode == 1 and "\nthree\n" in goes_on.stdout
    assert goes_on.stdout.strip().splitlines()[-1].startswith("ran 3 of 3 code cells")
    nb.cells[1].source = "2 / 1"
    nbformat.write(nb, path)
    fine = cli("run", str(path), "--kernel", kernelspec)
    assert fine.returncode == 0 and fine.stdout.strip().endswith(", no errors"), fine.stdout


def test_shell_lines_and_expansion_without_ipython(kernelspec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The python-stdlib rootfs has no IPython: the runner's plain mode runs `!command` lines
    and fills in `$name` / `{expr}` there too."""
    monkeypatch.setenv("SANDBOX_KERNEL_ROOTFS", "python-stdlib")
    with running_kernel(kernelspec) as (_, kc):
        assert execute(kc, "import IPython").of_type("error")[0]["ename"] == "ModuleNotFoundError"
        me = execute(kc, "import os; word = 'hello'; me = os.environ['SANDBOX_ID']; print(me)").text().strip()
        shell = execute(kc, "if True:\n    !echo $word {word.upper()} {len(word)}")
        assert shell.text() == "hello HELLO 5\n", [m["content"] for m in shell.outputs]
        # as in IPython: what does not evaluate leaves the whole line as it was
        assert execute(kc, "!echo {word} '{no such name}'").text() == "{word} {no such name}\n"
        said = execute(kc, "%sandbox attach {me}").text("stderr")
        assert said == f"sandbox-kernel: %sandbox attach: this notebook already drives {me}\n", said
