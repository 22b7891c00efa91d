"""runner_client.py, the light per-cell client, against a real runner daemon on the host
(as tests/test_runner.py runs it), started the way the kernel starts it: `-I -S`."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandbox_kernel.runner_client import waits_for_done, with_op
from test_runner import Daemon, b64, new_cell_id, parse

CLIENT = Path(__file__).resolve().parents[1] / "sandbox_kernel" / "runner_client.py"

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    running = Daemon(plain=True)
    try:
        yield running
    finally:
        running.stop()


def client(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-I", "-S", str(CLIENT), *args],
                          capture_output=True, text=True, timeout=30)


def test_only_builtin_modules_are_imported() -> None:
    probe = subprocess.run([sys.executable, "-I", "-S", "-X", "importtime", str(CLIENT)],
                           capture_output=True, text=True)
    imported = {line.split("|")[-1].strip() for line in probe.stderr.splitlines() if "|" in line}
    assert not imported & {"json", "base64", "socket", "re", "enum"}


def test_a_cell_streams_to_its_done_event_and_can_be_attached(daemon: Daemon) -> None:
    cell_id = new_cell_id()
    done = client("run", daemon.dir, b64({"cell_id": cell_id, "code": "print('hi')", "silent": False,
                                          "store_history": True, "wait": None}))
    events = parse(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr
    assert [e["text"] for e in events if e["type"] == "stream"] == ["hi\n"]
    assert events[-1]["type"] == "done" and events[-1]["status"] == "ok"
    replay = parse(client("attach", daemon.dir, b64({"cell_id": cell_id, "after": 1, "wait": None})).stdout)
    assert [e["seq"] for e in replay] == [e["seq"] for e in events[1:]]


def test_requests_answer_one_line(daemon: Daemon) -> None:
    answer = client("request", daemon.dir, b64({"op": "info"}))
    assert answer.returncode == 0
    assert json.loads(answer.stdout)["python_version"] == daemon.ready["python_version"]


def test_failures_are_one_json_line_or_usage() -> None:
    unreachable = client("request", "/nonexistent-dir", b64({"op": "info"}))
    assert unreachable.returncode == 1
    assert json.loads(unreachable.stdout)["error"].startswith("daemon unreachable:")
    for argv in (["run", "/tmp"], ["frobnicate", "/tmp", b64({})], ["run", "/tmp", "not base64!"],
                 ["run", "/tmp", b64([1, 2])]):  # type: ignore[list-item]
        bad = client(*argv)
        assert bad.returncode == 2 and bad.stderr.startswith("usage:")


def test_the_op_is_added_last_and_wait_is_read_without_parsing() -> None:
    assert json.loads(with_op(b'{"op": "x", "a": 1}', "run")) == {"op": "run", "a": 1}
    assert json.loads(with_op(b"{}", "attach")) == {"op": "attach"}
    assert waits_for_done(json.dumps({"code": "'\"wait\": 1'"}).encode())  # absent: follow
    assert waits_for_done(json.dumps({"wait": None}).encode())
    assert not waits_for_done(json.dumps({"code": "x", "wait": 1.0}).encode())
