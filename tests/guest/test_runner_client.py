"""guest/runner/client.py, the light per-cell client, against a real runner daemon on the host
(as tests/test_runner.py runs it), started the way the kernel starts it: `-I -S`."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandbox_kernel.guest.runner.client import waits_for_done, with_op
from test_runner import CLIENT, Daemon, b64, new_cell_id, parse

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


def test_a_cell_streams_to_its_done_event_and_can_be_followed_again(daemon: Daemon) -> None:
    cell_id = new_cell_id()
    done = client("run", daemon.dir, b64({"cell_id": cell_id, "code": "print('hi')", "silent": False,
                                          "store_history": True, "wait": None}))
    events = parse(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "".join(e["text"] for e in events if e["type"] == "stream") == "hi\n"
    assert events[-1]["type"] == "done" and events[-1]["status"] == "ok"
    replay = parse(client("run", daemon.dir, b64({"cell_id": cell_id, "after": 1, "wait": None})).stdout)
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
    assert json.loads(with_op(b"{}", "run")) == {"op": "run"}
    assert waits_for_done(json.dumps({"code": "'\"wait\": 1'"}).encode())  # absent: follow
    assert waits_for_done(json.dumps({"wait": None}).encode())
    assert not waits_for_done(json.dumps({"code": "x", "wait": 1.0}).encode())


# ------------------------------------------------------------------ channel (the relay)


class Relay:
    """`runner_client.py channel DIR` as the kernel starts it, its stdin and stdout ours."""

    def __init__(self, daemon: Daemon, *args: str) -> None:
        self.process = subprocess.Popen([sys.executable, "-I", "-S", str(CLIENT), "channel", daemon.dir, *args],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self.received = 0

    def send(self, message: dict) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(message).encode() + b"\n")
        self.process.stdin.flush()

    def ack(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(b'{"ack": %d}\n' % self.received)
        self.process.stdin.flush()

    def line(self) -> dict:
        assert self.process.stdout is not None
        raw = self.process.stdout.readline()
        self.received += len(raw)
        return json.loads(raw)

    def until(self, predicate) -> list[dict]:
        lines = [self.line()]
        while not predicate(lines[-1]):
            lines.append(self.line())
        return lines

    def close(self) -> int:
        assert self.process.stdin is not None
        self.process.stdin.close()
        return self.process.wait(10)


def test_the_relays_words_are_the_protocols() -> None:
    from sandbox_kernel.guest import protocol as runner_protocol
    from sandbox_kernel.guest.runner import client as runner_client, daemon
    from sandbox_kernel.guest.runner.wire import encode_line
    from sandbox_kernel.sandbox.channel import ACK_EVERY

    source = Path(CLIENT).read_text()
    assert f'{{"{runner_protocol.OP}": "{runner_protocol.CHANNEL}"' in source
    assert f'"{runner_protocol.BACKGROUND_AFTER}": %d' in source
    assert encode_line({runner_protocol.CHANNEL: runner_protocol.CHANNEL_TAKEN}).startswith(runner_client.TAKEN)
    assert runner_client.SOCKET_NAME == daemon.SOCKET_NAME and ACK_EVERY < runner_protocol.CHANNEL_WINDOW


def test_a_channel_carries_many_requests_with_tagged_events_and_replies(daemon: Daemon) -> None:
    relay = Relay(daemon)
    try:
        first, second = new_cell_id(), new_cell_id()
        relay.send({"op": "run", "cell_id": first, "code": "print('one')"})
        events = relay.until(lambda event: event.get("type") == "done")
        assert {event["cell"] for event in events} == {first}
        assert "".join(event["text"] for event in events if event["type"] == "stream") == "one\n"
        relay.send({"op": "info", "id": "r1"})
        relay.send({"op": "run", "cell_id": second, "code": "1 / 0"})
        # The reply and the cell's events share the channel, in whichever order they are ready
        # (info is answered on a thread of its own, the cell on the main thread).
        lines = relay.until(lambda event: event.get("type") == "done")
        [done] = [line for line in lines if line.get("type") == "done"]
        if not any(line.get("reply") == "r1" for line in lines):
            lines += relay.until(lambda event: event.get("reply") == "r1")
        [info] = [line for line in lines if line.get("reply") == "r1"]
        assert info["python_version"]
        assert done == {"cell": second, "seq": done["seq"], "type": "done", "status": "error",
                        "execution_count": done["execution_count"]}
        relay.send({"op": "complete", "id": "r2", "code": "pri", "cursor_pos": 3})
        assert "print" in relay.line()["matches"]
        relay.send({"op": "nonsense", "id": "r3"})
        assert relay.line()["error"].startswith("ValueError: unknown op")
    finally:
        assert relay.close() == 0, "the relay ends when the kernel closes its stdin"


def test_output_between_cells_reaches_the_channel_untagged(daemon: Daemon) -> None:
    relay = Relay(daemon)
    try:
        cell = new_cell_id()
        relay.send({"op": "run", "cell_id": cell, "code": (
            "import threading, time\n"
            "threading.Thread(target=lambda: (time.sleep(0.3), print('later', flush=True))).start()")})
        relay.until(lambda event: event.get("type") == "done")
        later = [relay.line()]
        while "".join(event.get("text", "") for event in later) != "later\n":  # perhaps in pieces
            later.append(relay.line())
        assert all(event["cell"] is None and event["type"] == "stream" for event in later)
    finally:
        relay.close()


def test_the_relay_writes_no_further_ahead_of_the_kernel_than_its_window(daemon: Daemon) -> None:
    from sandbox_kernel.guest.protocol import CHANNEL_WINDOW

    relay = Relay(daemon)
    out = relay.process.stdout
    assert out is not None
    try:
        size = CHANNEL_WINDOW + (1 << 20)
        relay.send({"op": "run", "cell_id": new_cell_id(), "code": f"import sys\nsys.stdout.write('z' * {size})",
                    "output_rate": 0})
        data = b""
        # Unacknowledged, it stops at its window (the cell has a MiB more to show).
        while select.select([out], [], [], 1.0)[0]:
            chunk = os.read(out.fileno(), 1 << 16)
            assert chunk
            data += chunk
        assert 0 < len(data) <= CHANNEL_WINDOW
        # Acknowledged as the kernel does (bytes received), it goes on to the end.
        while b'"type": "done"' not in data:
            relay.process.stdin.write(b'{"ack": %d}\n' % len(data))  # type: ignore[union-attr]
            relay.process.stdin.flush()  # type: ignore[union-attr]
            data += os.read(out.fileno(), 1 << 20)
        events = [json.loads(line) for line in data.splitlines()]
        assert "".join(e.get("text", "") for e in events if e["type"] == "stream") == "z" * size
    finally:
        relay.close()


def test_the_relay_hands_its_pipes_to_the_daemon_and_becomes_cat(daemon: Daemon) -> None:
    relay = Relay(daemon)
    try:
        relay.send({"op": "info", "id": "r1"})
        assert relay.line()["reply"] == "r1"  # served: by the daemon, on the pipes
        pid = relay.process.pid
        # The daemon serves as soon as it has the pipes; the relay becomes cat just after.
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}/cmdline").read_bytes() != b"cat\0" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert Path(f"/proc/{pid}/cmdline").read_bytes() == b"cat\0", "no Python stays in between"
        assert os.readlink(f"/proc/{pid}/fd/0").startswith("socket:")
        assert os.readlink(f"/proc/{pid}/fd/1") == "/dev/null", "only the daemon writes the kernel's stdout"
    finally:
        assert relay.close() == 0, "the relay ends when the kernel closes its stdin"


def test_a_killed_relay_ends_its_channel_in_the_daemon_which_serves_the_next(daemon: Daemon) -> None:
    relay = Relay(daemon)
    relay.send({"op": "info", "id": "r1"})
    assert relay.line()["reply"] == "r1"
    relay.process.kill()
    relay.process.wait(10)
    out = relay.process.stdout
    assert out is not None
    # The daemon let go of the pipe it wrote (cat's copy is /dev/null): the kernel's
    # stream reaches its end, as it would for a relay that died with its copy.
    assert select.select([out], [], [], 10)[0] and out.read() == b""
    fresh = Relay(daemon)
    try:
        fresh.send({"op": "info", "id": "r2"})
        assert fresh.line()["reply"] == "r2"
    finally:
        fresh.close()


def test_a_channel_request_without_the_pipes_is_refused(daemon: Daemon) -> None:
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(os.path.join(daemon.dir, "runner.sock"))
        sock.sendall(b'{"op": "channel"}\n')
        answer = json.loads(sock.makefile("rb").readline())
    assert answer["error"] == "ValueError: a channel comes with the relay's stdin and stdout"
