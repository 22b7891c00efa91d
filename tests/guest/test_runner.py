"""Tests of the runner (sandbox_kernel/guest/runner/), run as the kernel runs it: its bundle
copied as the kernel uploads it, a daemon subprocess started from there (on the host, in a
temporary directory) and short-lived clients.

Most tests run against both engines: IPython and the forced plain fallback.
"""
from __future__ import annotations

import atexit
import base64
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from sandbox_kernel.guest import bundle



def uploaded_bundle() -> str:
    """A directory holding the runner's bundle as the kernel uploads it (bundle.runner_files)."""
    root = tempfile.mkdtemp(prefix="skb-", dir="/tmp")
    atexit.register(shutil.rmtree, root, True)
    for relative, source in bundle.runner_files().items():
        os.makedirs(os.path.dirname(os.path.join(root, relative)), exist_ok=True)
        shutil.copy(source, os.path.join(root, relative))
    return root


BUNDLE_ROOT = uploaded_bundle()
RUNNER = bundle.runner_path(BUNDLE_ROOT)
CLIENT = bundle.client_path(BUNDLE_ROOT)  # the kernel's client of the daemon
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

pytestmark = pytest.mark.timeout(60)


def b64(message: dict) -> str:
    return base64.b64encode(json.dumps(message).encode()).decode()


def parse(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line]


def new_cell_id() -> str:
    return "cell-" + uuid.uuid4().hex


class Daemon:
    """A runner daemon in a temporary directory, and its clients."""

    def __init__(self, plain: bool):
        self.plain = plain
        # A short path: unix socket paths are limited to ~107 bytes.
        self.dir = tempfile.mkdtemp(prefix="skr-", dir="/tmp")
        env = dict(os.environ)
        env.pop("MPLBACKEND", None)
        if plain:
            env["SANDBOX_KERNEL_RUNNER_NO_IPYTHON"] = "1"
        self.log = open(os.path.join(self.dir, "runner.log"), "wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(RUNNER), "serve", self.dir],
            # Its own directory as cwd: files that cells write stay out of the checkout.
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log, env=env, cwd=self.dir,
        )
        ready = Path(self.dir, "ready")
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert self.proc.poll() is None, self.log_text()
            assert time.monotonic() < deadline, "daemon did not get ready"
            time.sleep(0.02)
        self.ready = json.loads(ready.read_text())

    def log_text(self) -> str:
        return Path(self.dir, "runner.log").read_text(errors="replace")

    def command(self, command: str, message: dict, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(CLIENT), command, self.dir, b64(message)],
                              capture_output=True, text=True, timeout=timeout)

    def popen(self, command: str, message: dict) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(CLIENT), command, self.dir, b64(message)],
                                stdout=subprocess.PIPE, text=True)

    def run(self, code: str, cell_id: str | None = None, silent: bool = False,
            store_history: bool = True, after: int = 0) -> list[dict]:
        result = self.command("run", {"cell_id": cell_id or new_cell_id(), "code": code, "silent": silent,
                                      "store_history": store_history, "after": after})
        assert result.returncode == 0, (result.stdout, result.stderr)
        return parse(result.stdout)

    def follow(self, cell_id: str, after: int = 0, wait: float | None = None) -> list[dict]:
        """A cell already submitted, from `after`: what the exec-per-cell transport sends
        after a dropped connection (its `run` again, code and all; the code is not needed)."""
        result = self.command("run", {"cell_id": cell_id, "after": after, "wait": wait})
        assert result.returncode == 0, (result.stdout, result.stderr)
        return parse(result.stdout)

    def request(self, message: dict) -> dict:
        result = self.command("request", message)
        lines = parse(result.stdout)
        assert len(lines) == 1, result.stdout
        return lines[0]

    def stop(self) -> None:
        try:
            if self.proc.poll() is None:
                self.request({"op": "shutdown"})
                self.proc.wait(5)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.log.close()
            shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module", params=["ipython", "plain"])
def daemon(request):
    d = Daemon(plain=request.param == "plain")
    yield d
    d.stop()


@pytest.fixture(scope="module")
def ipython_daemon():
    d = Daemon(plain=False)
    yield d
    d.stop()


def of_type(events: list[dict], type_: str) -> list[dict]:
    return [event for event in events if event["type"] == type_]


def streams(events: list[dict]) -> list[tuple[str, str]]:
    """Stream output as (name, text) runs, adjacent events of one stream merged."""
    runs: list[tuple[str, str]] = []
    for event in of_type(events, "stream"):
        if runs and runs[-1][0] == event["name"]:
            runs[-1] = (event["name"], runs[-1][1] + event["text"])
        else:
            runs.append((event["name"], event["text"]))
    return runs


def stdout_of(events: list[dict]) -> str:
    return "".join(event["text"] for event in of_type(events, "stream") if event["name"] == "stdout")


def plain_text(lines: list[str]) -> str:
    """Traceback lines joined, without ANSI colours."""
    return re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(lines))


def assert_well_formed(events: list[dict]) -> None:
    assert [event["seq"] for event in events] == list(range(1, len(events) + 1))
    assert events[-1]["type"] == "done"
    assert of_type(events, "done") == [events[-1]]


# ------------------------------------------------------------------ basics


def test_ready_file_and_info(daemon):
    assert daemon.ready["pid"] == daemon.proc.pid
    assert daemon.ready["python_version"] == "%d.%d.%d" % sys.version_info[:3]
    assert daemon.ready["implementation"] == "CPython"
    # The ready file comes before IPython has started; the info op waits for it.
    assert "ipython_version" not in daemon.ready
    info = daemon.request({"op": "info"})
    if daemon.plain:
        assert info["ipython_version"] is None
    else:
        import IPython
        assert info["ipython_version"] == IPython.__version__
    assert {key: info[key] for key in daemon.ready} == daemon.ready
    assert isinstance(info["execution_count"], int)
    assert oct(os.stat(daemon.dir).st_mode & 0o777) == "0o700"
    assert oct(os.stat(os.path.join(daemon.dir, "runner.sock")).st_mode & 0o777) == "0o600"


def test_state_persists_across_cells(daemon):
    assert_well_formed(daemon.run("persisted_value = 20"))
    events = daemon.run("print(persisted_value + 1)")
    assert_well_formed(events)
    assert streams(events) == [("stdout", "21\n")]
    assert events[-1]["status"] == "ok"


def test_stdout_stderr_interleaving(daemon):
    code = "import sys\nprint('a')\nprint('b', file=sys.stderr)\nprint('c')\nsys.stderr.write('d\\n')"
    assert streams(daemon.run(code)) == [("stdout", "a\n"), ("stderr", "b\n"), ("stdout", "c\n"), ("stderr", "d\n")]


def test_fd_level_output_is_captured_in_order(daemon):
    code = ("import os, subprocess, sys\n"
            "print('a')\n"
            "os.write(1, b'b\\n')\n"
            "print('c')\n"
            "os.write(2, 'h\\u00e9\\n'.encode())\n"
            "subprocess.run([sys.executable, '-c', 'print(\"child\")'])\n")
    assert streams(daemon.run(code)) == [("stdout", "a\nb\nc\n"), ("stderr", "h\u00e9\n"), ("stdout", "child\n")]


def test_split_utf8_from_fd_is_not_mangled(daemon):
    code = "import os, time\nos.write(1, b'\\xc3')\ntime.sleep(0.1)\nos.write(1, b'\\xa9!\\n')"
    assert stdout_of(daemon.run(code)) == "\u00e9!\n"


def test_bang_command_ipython(ipython_daemon):
    events = ipython_daemon.run("!echo hi from shell")
    # IPython runs !cmd in a pty, hence the \r\n.
    assert stdout_of(events).replace("\r\n", "\n") == "hi from shell\n"


def test_large_output_is_complete_and_coalesced(daemon):
    events = daemon.run("for i in range(200000):\n    print(i)")
    assert stdout_of(events) == "".join("%d\n" % i for i in range(200000))
    # Coalesced: far fewer events than prints (how many depends on the machine's speed,
    # as text is flushed every few milliseconds).
    assert len(of_type(events, "stream")) < 2000


# ---------------------------------------------------------- results, display


def test_execute_result_and_counts(daemon):
    first = daemon.run("class Html:\n"
                       "    def _repr_html_(self):\n"
                       "        return '<b>hi</b>'\n"
                       "    def __repr__(self):\n"
                       "        return 'Html()'\n"
                       "Html()")
    count = first[-1]["execution_count"]
    assert of_type(first, "execute_result") == [{
        "seq": 1, "type": "execute_result", "execution_count": count,
        "data": {"text/plain": "Html()", "text/html": "<b>hi</b>"}, "metadata": {}}]
    assert first[-1] == {"seq": 2, "type": "done", "status": "ok", "execution_count": count}

    assignment = daemon.run("y = 1")
    assert assignment[-1]["execution_count"] == count + 1
    assert of_type(assignment, "execute_result") == []
    assert of_type(daemon.run("y + 1;"), "execute_result") == []

    silent = daemon.run("y + 1", silent=True)
    assert of_type(silent, "execute_result") == []
    unstored = daemon.run("y + 2", store_history=False)
    assert of_type(unstored, "execute_result")[0]["data"]["text/plain"] == "3"
    assert daemon.run("y")[-1]["execution_count"] == count + 3


def test_display_update_and_clear_ipython(ipython_daemon):
    events = ipython_daemon.run("from IPython.display import display, update_display, clear_output\n"
                                "display('one', display_id='d1')\n"
                                "update_display('two', display_id='d1')\n"
                                "clear_output(wait=True)\n"
                                "display({'a': 1}, raw=True)")
    assert [event for event in events if event["type"] != "done"] == [
        {"seq": 1, "type": "display_data", "data": {"text/plain": "'one'"}, "metadata": {},
         "transient": {"display_id": "d1"}},
        {"seq": 2, "type": "update_display_data", "data": {"text/plain": "'two'"}, "metadata": {},
         "transient": {"display_id": "d1"}},
        {"seq": 3, "type": "clear_output", "wait": True},
        {"seq": 4, "type": "display_data", "data": {"a": 1}, "metadata": {}, "transient": {}},
    ]


def test_display_builtin_plain(daemon):
    events = daemon.run("display('x')")
    assert of_type(events, "display_data")[0]["data"] == {"text/plain": "'x'"}


def test_matplotlib_figure_is_shown_as_png(daemon):
    events = daemon.run("import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nNone")
    images = [event for event in of_type(events, "display_data") if "image/png" in event["data"]]
    assert len(images) == 1
    assert base64.b64decode(images[0]["data"]["image/png"]).startswith(PNG_MAGIC)
    # Shown figures are closed: the next cell does not show it again.
    assert of_type(daemon.run("1"), "display_data") == []


# ------------------------------------------------------------------ errors


def test_error_event(daemon):
    events = daemon.run("def inner():\n    return 1 / 0\n\ninner()")
    [error] = of_type(events, "error")
    assert error["ename"] == "ZeroDivisionError"
    assert error["evalue"] == "division by zero"
    text = plain_text(error["traceback"])
    assert bundle.PACKAGE not in text  # no frame of the runner's
    assert "return 1 / 0" in text  # the cell's source is shown
    assert events[-1]["status"] == "error"


def test_syntax_error(daemon):
    events = daemon.run("x = (1,\nprint('never')")
    [error] = of_type(events, "error")
    assert error["ename"] == "SyntaxError"
    assert bundle.PACKAGE not in plain_text(error["traceback"])
    assert of_type(events, "stream") == []
    assert events[-1]["status"] == "error"


@pytest.mark.parametrize("code", ["import sys\nsys.exit(3)", "exit()", "raise SystemExit"])
def test_exit_does_not_kill_the_daemon(daemon, code):
    events = daemon.run(code)
    assert events[-1]["type"] == "done"
    assert daemon.proc.poll() is None
    assert stdout_of(daemon.run("print('alive')")) == "alive\n"


# --------------------------------------------------------------- interrupt


def read_until(proc: subprocess.Popen, type_: str) -> list[dict]:
    events = []
    while True:
        line = proc.stdout.readline()
        assert line, "client ended before a %s event" % type_
        events.append(json.loads(line))
        if events[-1]["type"] == type_:
            return events


def assert_interrupt_stops(daemon, code):
    """Run code, interrupt it once it printed, check it stopped within 2 s; return its events."""
    cell_id = new_cell_id()
    client = daemon.popen("run", {"cell_id": cell_id, "code": "print('go', flush=True)\n" + code,
                                  "silent": False, "store_history": True})
    read_until(client, "stream")
    started = time.monotonic()
    assert daemon.request({"op": "interrupt"}) == {"ok": True, "running": cell_id}
    rest = read_until(client, "done")
    assert time.monotonic() - started < 2
    assert client.wait(5) == 0
    assert of_type(rest, "error")[0]["ename"] == "KeyboardInterrupt"
    return rest


@pytest.mark.parametrize("code", ["while True: pass", "import time\ntime.sleep(100)"])
def test_interrupt(daemon, code):
    rest = assert_interrupt_stops(daemon, code)
    assert rest[-1]["status"] == "error"
    assert stdout_of(daemon.run("print('still here')")) == "still here\n"
    assert daemon.request({"op": "interrupt"}) == {"ok": True, "running": None}


# -------------------------------------------------------------------- input


@pytest.mark.parametrize("function, password", [("input", False), ("__import__('getpass').getpass", True)])
def test_input_round_trip(daemon, function, password):
    cell_id = new_cell_id()
    client = daemon.popen("run", {"cell_id": cell_id, "code": "answer = %s('name? ')\nprint('got', answer)" % function,
                                  "silent": False, "store_history": True})
    events = read_until(client, "input_request")
    assert events[-1]["prompt"] == "name? "
    assert events[-1]["password"] is password
    assert daemon.request({"op": "input", "cell_id": "other", "value": "x"}) == {"ok": False}
    assert daemon.request({"op": "input", "cell_id": cell_id, "value": "Bob"}) == {"ok": True}
    events += read_until(client, "done")
    assert client.wait(5) == 0
    assert_well_formed(events)
    assert stdout_of(events) == "got Bob\n"


def test_interrupt_wakes_input(daemon):
    client = daemon.popen("run", {"cell_id": new_cell_id(), "code": "input()", "silent": False,
                                  "store_history": True})
    read_until(client, "input_request")
    daemon.request({"op": "interrupt"})
    events = read_until(client, "done")
    assert client.wait(5) == 0
    assert of_type(events, "error")[0]["ename"] == "KeyboardInterrupt"


# -------------------------------------------------------- following a cell again


def test_run_is_idempotent(daemon):
    daemon.run("runs_counter = 0")
    cell_id = new_cell_id()
    first = daemon.run("runs_counter += 1\nprint(runs_counter)", cell_id=cell_id)
    again = daemon.run("runs_counter += 1\nprint(runs_counter)", cell_id=cell_id)
    assert again == first
    assert stdout_of(daemon.run("print(runs_counter)", cell_id=new_cell_id())) == "1\n"
    assert daemon.run("ignored", cell_id=cell_id, after=1) == first[1:]


def test_a_repeated_run_replays_exactly_the_tail(daemon):
    cell_id = new_cell_id()
    events = daemon.run("import sys\nfor i in range(3):\n    print(i, flush=True)\n"
                        "    sys.stderr.write('e\\n')\n", cell_id=cell_id)
    assert_well_formed(events)
    for after in (0, 2, len(events) - 1):  # never past done: the transport stops there
        assert daemon.follow(cell_id, after=after) == events[after:]


def test_a_repeated_run_with_wait_returns_while_running(daemon):
    cell_id = new_cell_id()
    client = daemon.popen("run", {"cell_id": cell_id, "code": "import time\nprint('x', flush=True)\ntime.sleep(1.5)",
                                  "silent": False, "store_history": True})
    read_until(client, "stream")
    polled = daemon.follow(cell_id, after=0, wait=0.2)
    assert polled[0]["seq"] == 1 and stdout_of(polled) == "x\n"
    assert daemon.follow(cell_id, after=polled[-1]["seq"], wait=None)[-1]["type"] == "done"
    client.wait(5)


def test_run_with_wait_submits_and_returns_early(daemon):
    """How a cell starts when the service cannot stream: later events come by runs with `after`."""
    cell_id = new_cell_id()
    started = daemon.command("run", {"cell_id": cell_id, "code": "import time\nprint('x', flush=True)\n"
                                     "time.sleep(1.5)\nprint('y')", "wait": 0.5})
    assert started.returncode == 0
    # A print may come as two stream events (its text, then its newline) if the runner's
    # flusher runs between its two writes, as it can under load.
    first = parse(started.stdout)
    assert first[0]["seq"] == 1 and stdout_of(first) == "x\n"
    rest = daemon.follow(cell_id, after=first[-1]["seq"], wait=None)
    assert rest[-1]["type"] == "done" and stdout_of(rest) == "y\n"


def test_resume_after_client_killed(daemon):
    cell_id = new_cell_id()
    code = "import time\nfor i in range(40):\n    print(i, flush=True)\n    time.sleep(0.02)"
    client = daemon.popen("run", {"cell_id": cell_id, "code": code, "silent": False, "store_history": True})
    seen = []
    while len(seen) < 4:
        seen.append(json.loads(client.stdout.readline()))
    client.send_signal(signal.SIGKILL)
    client.wait()
    rest = daemon.follow(cell_id, after=seen[-1]["seq"])
    events = seen + rest
    assert_well_formed(events)
    assert stdout_of(events) == "".join("%d\n" % i for i in range(40))


@pytest.mark.parametrize("cell_id", ["../escape", "", "a" * 129, "sp ace"])
def test_bad_cell_id_is_rejected(daemon, cell_id):
    result = daemon.command("run", {"cell_id": cell_id, "code": "print(1)"})
    assert result.returncode == 1
    assert "error" in json.loads(result.stdout)
    assert not list(Path(daemon.dir).rglob("escape*"))


def test_code_file_is_read_and_deleted(daemon):
    code_file = Path(daemon.dir, "big-cell.py")
    code_file.write_text("print('from file')")
    result = daemon.command("run", {"cell_id": new_cell_id(), "code_file": str(code_file),
                                    "silent": False, "store_history": True})
    assert stdout_of(parse(result.stdout)) == "from file\n"
    assert not code_file.exists()


# ----------------------------------------------------- complete, inspect


def test_complete(daemon):
    daemon.run("my_unique_variable = 1")
    reply = daemon.request({"op": "complete", "code": "x = my_uniq", "cursor_pos": 11})
    assert reply["matches"] == ["my_unique_variable"]
    assert (reply["cursor_start"], reply["cursor_end"], reply["metadata"]) == (4, 11, {})


def test_complete_while_a_cell_runs(daemon):
    client = daemon.popen("run", {"cell_id": new_cell_id(), "code": "import time\nprint(1, flush=True)\ntime.sleep(1)",
                                  "silent": False, "store_history": True})
    read_until(client, "stream")
    assert "my_unique_variable" in daemon.request({"op": "complete", "code": "my_uni", "cursor_pos": 6})["matches"]
    client.wait(5)


def test_inspect(daemon):
    daemon.run("def documented(a, b=2):\n    'Adds things.'\n    return a + b")
    reply = daemon.request({"op": "inspect", "code": "documented(", "cursor_pos": 11, "detail_level": 0})
    assert reply["found"] is True
    text = plain_text([reply["data"]["text/plain"]])
    assert "Adds things." in text and "b=2" in text
    missing = daemon.request({"op": "inspect", "code": "no_such_name", "cursor_pos": 3, "detail_level": 0})
    assert missing["found"] is False


# --------------------------------------------------------- command line


def test_usage_errors():
    for argv in ([], ["run"], ["bogus", "/tmp", "e30="], ["run", "/tmp", "not base64!"]):
        result = subprocess.run([sys.executable, str(RUNNER), *argv], capture_output=True, text=True)
        assert result.returncode == 2
        assert "usage" in result.stderr


def test_unreachable_daemon():
    result = subprocess.run([sys.executable, str(CLIENT), "request", "/nonexistent-dir", b64({"op": "info"})],
                            capture_output=True, text=True)
    assert result.returncode == 1
    assert "error" in json.loads(result.stdout)


def test_unknown_op(daemon):
    result = daemon.command("request", {"op": "bogus"})
    assert result.returncode == 1
    assert "error" in json.loads(result.stdout)


def test_shutdown_removes_socket_and_ready():
    d = Daemon(plain=True)
    try:
        assert d.request({"op": "shutdown"}) == {"ok": True}
        assert d.proc.wait(5) == 0
        assert not Path(d.dir, "runner.sock").exists()
        assert not Path(d.dir, "ready").exists()
    finally:
        d.stop()


def test_output_outside_cells_goes_to_log(daemon):
    daemon.run("import threading, time\n"
               "threading.Thread(target=lambda: (time.sleep(0.3), print('late output'))).start()")
    time.sleep(0.6)
    assert "late output" in daemon.log_text()


# ------------------------------------------- what ipykernel does (issue 14)


def result_text(events: list[dict]) -> str:
    [result] = of_type(events, "execute_result")
    return result["data"]["text/plain"]


def run_request(daemon, **request) -> list[dict]:
    result = daemon.command("run", {"cell_id": new_cell_id(), "silent": False, "store_history": True, **request})
    assert result.returncode == 0, (result.stdout, result.stderr)
    return parse(result.stdout)


def test_cells_run_on_an_event_loop_that_runs_between_them(daemon):
    assert result_text(daemon.run("import asyncio\nawait asyncio.sleep(0)\n"
                                  "asyncio.get_running_loop().is_running()")) == "True"
    daemon.run("import threading\nloop_ran = threading.Event()\n"
               "async def mark():\n    loop_ran.set()\n"
               "marker = asyncio.get_running_loop().create_task(mark())")
    assert result_text(daemon.run("loop_ran.is_set()")) == "True"


def test_an_interrupt_cancels_an_awaiting_cell(daemon):
    cell_id = new_cell_id()
    client = daemon.popen("run", {"cell_id": cell_id, "silent": False, "store_history": True,
                                  "code": "import asyncio\nprint('go', flush=True)\nawait asyncio.sleep(100)"})
    read_until(client, "stream")
    assert daemon.request({"op": "interrupt"}) == {"ok": True, "running": cell_id}
    rest = read_until(client, "done")
    assert client.wait(5) == 0
    assert rest[-1]["status"] == "error"
    assert of_type(rest, "error")[0]["ename"] in ("CancelledError", "KeyboardInterrupt")
    assert stdout_of(daemon.run("print('still here')")) == "still here\n"


def test_user_expressions_come_with_done(daemon):
    events = run_request(daemon, code="base = 20", user_expressions={"sum": "base + 1", "bad": "nope"})
    done = events[-1]
    assert done["user_expressions"]["sum"] == {"status": "ok", "data": {"text/plain": "21"}, "metadata": {}}
    assert done["user_expressions"]["bad"]["status"] == "error"
    assert done["user_expressions"]["bad"]["ename"] == "NameError"
    failed = run_request(daemon, code="1 / 0", user_expressions={"sum": "base + 1"})[-1]
    assert failed["status"] == "error" and "user_expressions" not in failed


def test_input_without_stdin_raises_stdin_not_implemented(daemon):
    events = run_request(daemon, code="input()", allow_stdin=False)
    assert not of_type(events, "input_request")
    assert of_type(events, "error")[0]["ename"] == "StdinNotImplementedError"


def test_pager_and_next_input_payloads(ipython_daemon):
    [page] = ipython_daemon.run("len?")[-1]["payload"]
    assert page["source"] == "page" and "Return the number of items" in page["data"]["text/plain"]
    [next_input] = ipython_daemon.run("%recall 1")[-1]["payload"]
    assert next_input["source"] == "set_next_input" and next_input["replace"] is False


def test_output_of_a_forked_child(daemon):
    events = daemon.run("import multiprocessing as mp\n"
                        "child = mp.get_context('fork').Process(target=print, args=('child says hi',))\n"
                        "child.start(); child.join()")
    assert stdout_of(events) == "child says hi\n"


def test_usage_measures_the_daemon_and_its_children(daemon):
    first = daemon.request({"op": "usage"})
    assert first["pid"] == daemon.proc.pid and first["kernel_cpu"] == 0.0
    daemon.run("import subprocess, sys\n"
               "sleeper = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])")
    second = daemon.request({"op": "usage"})
    assert second["kernel_memory"] > first["kernel_memory"]  # the child's memory counts
    assert second["kernel_cpu"] >= 0 and second["cpu_count"] >= 1
    assert second["meminfo"]["total"] >= second["meminfo"]["available"] > 0
    daemon.run("sleeper.kill(); sleeper.wait()")


def test_comms_in_the_sandbox(daemon):
    events = daemon.run("import comm\nc = comm.create_comm(target_name='t', data={'x': 1}, buffers=[b'\\x00'])")
    [opened] = of_type(events, "comm")
    assert opened["msg_type"] == "comm_open" and opened["content"]["target_name"] == "t"
    assert opened["buffers"] == [base64.b64encode(b"\x00").decode()]
    comm_id = opened["content"]["comm_id"]
    assert daemon.request({"op": "comm_info", "target_name": "t"}) == {"comms": {comm_id: {"target_name": "t"}}}
    daemon.run("got = []\nc.on_msg(lambda msg: got.append((msg['content']['data'], bytes(msg['buffers'][0]))))")
    message = {"msg_type": "comm_msg", "content": {"comm_id": comm_id, "data": {"y": 2}},
               "buffers": [base64.b64encode(b"\x01\x02").decode()]}
    assert run_request(daemon, code="", silent=True, comm=message)[-1]["status"] == "ok"
    assert result_text(daemon.run("got")) == "[({'y': 2}, b'\\x01\\x02')]"
    refused = daemon.command("run", {"cell_id": new_cell_id(), "code": "", "comm": {"msg_type": "exec"}})
    assert "comm request" in parse(refused.stdout)[0]["error"]


def test_output_names_the_request_its_thread_or_task_chose(ipython_daemon):
    """ipykernel's shell API: a thread that chose its cell's parent (set_thread_parent), and an
    asyncio task a cell started, print into a later cell's events naming the first request."""
    run_request(ipython_daemon, parent_msg_id="request-a", code=(
        "import asyncio, threading\nparent = get_ipython().get_parent()\ngo = threading.Event()\n"
        "def work():\n    token = get_ipython().set_thread_parent(parent)\n    go.wait()\n"
        "    print('thread chose a', flush=True)\n    get_ipython().reset_thread_parent(token)\n"
        "    print('thread back to the running cell', flush=True)\n"
        "thread = threading.Thread(target=work)\nthread.start()\n"
        "async def later():\n    await asyncio.sleep(0.2)\n    print('task of a', flush=True)\n"
        "task = asyncio.get_running_loop().create_task(later())"))
    events = run_request(ipython_daemon, parent_msg_id="request-b", code=(
        "print(get_ipython().get_parent()['header']['msg_id'], flush=True)\ngo.set()\nthread.join()\n"
        "await task"))
    assert [(event["text"], event.get("parent")) for event in of_type(events, "stream")] == [
        ("request-b\n", None), ("thread chose a\n", "request-a"), ("thread back to the running cell\n", None),
        ("task of a\n", "request-a")]


def start_printing_cell(daemon, code: str, **fields) -> subprocess.Popen:
    """Run a cell that prints first, once that print has come (so the cell is running)."""
    cell_id = new_cell_id()
    client = daemon.popen("run", {"cell_id": cell_id, "code": "print('started', flush=True)\n" + code, **fields})
    wait_until_known(daemon, cell_id)
    while not of_type(daemon.follow(cell_id, wait=0.1), "stream"):
        pass
    return client


def wait_until_known(daemon, cell_id: str) -> None:
    """Until the daemon has the cell another client submitted (a run with no code fails before)."""
    while daemon.command("run", {"cell_id": cell_id, "wait": 0}).returncode:
        pass


def test_a_comm_message_reaches_a_cell_that_awaits_it(daemon):
    """A widget's answer arrives while the cell awaits it; a cell that never awaits gets its
    messages after it ends, in the order they came; a handler's output names its request."""
    events = daemon.run("import asyncio, comm\nc = comm.create_comm(target_name='t')\n"
                        "answer = asyncio.get_running_loop().create_future()\n"
                        "c.on_msg(lambda msg: (print('handled'), answer.set_result(msg['content']['data'])))")
    comm_id = of_type(events, "comm")[0]["content"]["comm_id"]
    waiting = start_printing_cell(daemon, "print(await asyncio.wait_for(answer, 20))", parent_msg_id="cell-request")
    message = {"msg_type": "comm_msg", "content": {"comm_id": comm_id, "data": {"value": 42}}}
    delivered = run_request(daemon, code="", silent=True, comm=message, parent_msg_id="comm-request")
    assert delivered[-1]["status"] == "ok", delivered
    cell = parse(waiting.communicate(timeout=30)[0])
    assert cell[-1]["status"] == "ok", cell
    assert [(event["text"], event.get("parent")) for event in of_type(cell, "stream")] == [
        ("started\n", None), ("handled\n", "comm-request"), ("{'value': 42}\n", None)]

    daemon.run("got = []\nc.on_msg(lambda msg: got.append(msg['content']['data']['n']))")
    busy = start_printing_cell(daemon, "import time\ntime.sleep(2)\nlen(got)")
    senders = []
    for n in range(3):  # one after the other: each is known to the daemon before the next is sent
        cell_id = new_cell_id()
        senders.append(daemon.popen("run", {"cell_id": cell_id, "code": "", "silent": True, "comm": {
            "msg_type": "comm_msg", "content": {"comm_id": comm_id, "data": {"n": n}}}}))
        wait_until_known(daemon, cell_id)
    assert result_text(parse(busy.communicate(timeout=30)[0])) == "0"  # it never awaited: none came during it
    for sender in senders:
        assert parse(sender.communicate(timeout=30)[0])[-1]["status"] == "ok"
    assert result_text(daemon.run("got")) == "[0, 1, 2]"


def test_edit_tells_the_frontend_which_file_to_open(ipython_daemon):
    ipython_daemon.run("with open('edited.py', 'w') as f:\n    f.write('x = 1\\n')")
    events = ipython_daemon.run("%edit edited.py")
    [payload] = events[-1]["payload"]
    assert payload["source"] == "edit_magic" and payload["filename"].endswith("/edited.py")
    assert events[-1]["status"] == "ok" and not of_type(events, "error")
    assert ipython_daemon.run("%ed edited.py")[-1]["payload"][0]["source"] == "edit_magic"


@pytest.mark.parametrize("first_import", ["import pdb", "from IPython.core import debugger"])
def test_pdb_is_ipythons_interruptible_one_from_its_first_import(first_import):
    """Loaded when a cell first imports it (an idle runner has neither module: memory), and
    then pdb's debugger is IPython's that an interrupt ends, whichever was imported first."""
    daemon = Daemon(plain=False)
    try:
        loaded = "print([name for name in ('pdb', 'IPython.core.debugger') if name in sys.modules])"
        assert stdout_of(daemon.run("import sys\n" + loaded)) == "[]\n"
        events = daemon.run(first_import + "\nimport pdb\nprint(pdb.Pdb.__name__, pdb.set_trace.__module__)")
        assert stdout_of(events) == "InterruptiblePdb IPython.core.debugger\n", events
    finally:
        daemon.stop()
