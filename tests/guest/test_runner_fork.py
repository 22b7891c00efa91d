"""Tests of the runner's fork op: the daemon forks itself (os.fork) into a new
directory and/or the namespaces of another process, and both halves go on as
independent daemons. Daemons run on the host, as in tests/guest/test_runner.py.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from test_runner import (
    Daemon, assert_interrupt_stops, new_cell_id, of_type, read_until, stdout_of, streams)

pytestmark = pytest.mark.timeout(60)

FORK_EVALUE = "this cell was running when the sandbox was forked; it continues only in the original sandbox"


class Forked(Daemon):
    """A daemon forked from another one: same client helpers, no Popen of ours
    (it is the parent daemon's child, which reaps it)."""

    def __init__(self, directory: str, pid: int, plain: bool):
        self.dir = directory
        self.pid = pid
        self.plain = plain
        self.ready = json.loads(Path(directory, "ready").read_text())

    def log_text(self) -> str:
        path = Path(self.dir, "runner.log")
        return path.read_text(errors="replace") if path.exists() else ""

    def alive(self) -> bool:
        try:
            with open("/proc/%d/stat" % self.pid) as stat:
                return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    def stop(self) -> None:
        try:
            if self.alive():
                self.command("request", {"op": "shutdown"}, timeout=10)
                deadline = time.monotonic() + 5
                while self.alive() and time.monotonic() < deadline:
                    time.sleep(0.02)
        finally:
            if self.alive():
                os.kill(self.pid, signal.SIGKILL)
            shutil.rmtree(self.dir, ignore_errors=True)


def fork_to_new_dir(parent: Daemon) -> Forked:
    directory = tempfile.mkdtemp(prefix="skf-", dir="/tmp")
    os.rmdir(directory)  # the child creates it
    reply = parent.request({"op": "fork", "join_pid": None, "dir": directory})
    assert reply.get("ok") is True, (reply, parent.log_text())
    return Forked(directory, reply["child_pid"], parent.plain)


@pytest.fixture(scope="module", params=["ipython", "plain"])
def pair(request):
    parent = Daemon(plain=request.param == "plain")
    child = None
    try:
        parent.run("x = 1\nimport colorsys\nf = open(%r, 'w')\nf.write('a')\nf.flush()"
                   % os.path.join(parent.dir, "data.txt"))
        before = parent.request({"op": "info"})["execution_count"]
        child = fork_to_new_dir(parent)
        # The first cells after the fork, for the execution count test.
        firsts = (parent.run("pass"), child.run("pass"))
        yield parent, child, before, firsts
    finally:
        if child is not None:
            child.stop()
        parent.stop()


def test_child_has_the_parents_live_state(pair):
    parent, child, _, _ = pair
    assert child.ready["pid"] == child.pid != parent.proc.pid
    assert child.request({"op": "info"})["pid"] == child.pid
    events = child.run("f.write('b')\nf.flush()\n"
                       "print(x, colorsys.rgb_to_hsv(1, 0, 0), 'colorsys' in __import__('sys').modules)")
    assert events[-1]["status"] == "ok", events
    assert stdout_of(events) == "1 (0.0, 1.0, 1) True\n"
    # The file object is shared with the parent (same open file description).
    assert stdout_of(parent.run("print(open(f.name).read())")) == "ab\n"
    assert oct(os.stat(child.dir).st_mode & 0o777) == "0o700"


def test_execution_counts_continue_in_both(pair):
    _, _, before, (parent_first, child_first) = pair
    assert parent_first[-1]["execution_count"] == before
    assert child_first[-1]["execution_count"] == before


def test_state_is_independent(pair):
    parent, child, _, _ = pair
    child.run("x = 'child'")
    assert stdout_of(parent.run("print(x)")) == "1\n"
    parent.run("x = 'parent'")
    assert stdout_of(child.run("print(x)")) == "child\n"
    assert stdout_of(parent.run("print(x)")) == "parent\n"


@pytest.mark.parametrize("which", ["child", "parent"])
def test_output_display_interrupt_input_complete(pair, which):
    parent, child, _, _ = pair
    daemon = child if which == "child" else parent
    # Streams: Python-level, fd-level and a subprocess, in order.
    events = daemon.run("import os, subprocess, sys\nprint('a')\nos.write(1, b'b\\n')\n"
                        "subprocess.run([sys.executable, '-c', 'print(3)'])\nsys.stderr.write('e\\n')")
    # How the text is cut into events depends on timing; what it says, and its order, not.
    assert streams(events) == [("stdout", "a\nb\n3\n"), ("stderr", "e\n")]
    # display_data and execute_result.
    events = daemon.run("display('shown')\n6 * 7")
    assert of_type(events, "display_data")[0]["data"]["text/plain"] == "'shown'"
    assert of_type(events, "execute_result")[0]["data"]["text/plain"] == "42"
    # Interrupt.
    assert_interrupt_stops(daemon, "while True: pass")
    # input() round trip.
    cell_id = new_cell_id()
    client = daemon.popen("run", {"cell_id": cell_id, "code": "answer = input('name? ')\nprint('got', answer)",
                                  "silent": False, "store_history": True})
    assert read_until(client, "input_request")[-1]["prompt"] == "name? "
    assert daemon.request({"op": "input", "cell_id": cell_id, "value": "Bob"}) == {"ok": True}
    assert stdout_of(read_until(client, "done")) == "got Bob\n"
    assert client.wait(5) == 0
    # complete.
    daemon.run("forked_unique_name = 1")
    assert daemon.request({"op": "complete", "code": "forked_uniq", "cursor_pos": 11})["matches"] == [
        "forked_unique_name"]


def test_fork_while_a_cell_runs_and_another_is_queued(pair):
    parent, _, _, _ = pair
    running_id, queued_id = new_cell_id(), new_cell_id()
    running = parent.popen("run", {"cell_id": running_id, "silent": False, "store_history": True,
                                   "code": "import time\nprint('before', flush=True)\ntime.sleep(3)\nprint('after')"})
    first = read_until(running, "stream")
    queued = parent.popen("run", {"cell_id": queued_id, "code": "print('queued ran')", "silent": False,
                                  "store_history": True})
    time.sleep(0.2)  # let the queued cell be submitted
    child = fork_to_new_dir(parent)
    try:
        # In the child both end with a ForkError, after what they had already output.
        events = child.follow(running_id)
        assert events[:len(first)] == first
        assert [e["type"] for e in events[len(first):]] == ["error", "done"]
        assert events[-2]["ename"] == "ForkError" and events[-2]["evalue"] == FORK_EVALUE
        assert events[-1]["status"] == "error"
        assert stdout_of(events) == "before\n"
        dropped = child.follow(queued_id)
        assert [e["type"] for e in dropped] == ["error", "done"]
        assert dropped[0]["ename"] == "ForkError" and dropped[-1]["status"] == "error"
        # The child goes on; the running cell's number is used up.
        next_cell = child.run("print('child alive')")
        assert stdout_of(next_cell) == "child alive\n"
        assert next_cell[-1]["execution_count"] == events[-1]["execution_count"] + 1
        # In the parent both complete normally.
        rest = read_until(running, "done")
        assert rest[-1]["status"] == "ok" and stdout_of(first + rest) == "before\nafter\n"
        assert rest[-1]["execution_count"] == events[-1]["execution_count"]
        assert running.wait(5) == 0
        queued_events = read_until(queued, "done")
        assert stdout_of(queued_events) == "queued ran\n" and queued_events[-1]["status"] == "ok"
        assert queued.wait(5) == 0
        # The parent's record of the cell was not touched by the child.
        assert "ForkError" not in json.dumps(parent.follow(running_id))
    finally:
        child.stop()


def test_bad_fork_requests_leave_the_parent_working(pair):
    parent, _, _, _ = pair
    for bad in ({"op": "fork"}, {"op": "fork", "join_pid": "1"}, {"op": "fork", "dir": 3}):
        result = parent.command("request", bad)
        assert result.returncode == 1 and "error" in json.loads(result.stdout), bad
    assert parent.request({"op": "fork", "join_pid": None, "dir": parent.dir})["ok"] is False
    reply = parent.request({"op": "fork", "join_pid": 999999999, "dir": None})
    assert reply["ok"] is False and "999999999" in reply["error"]
    assert Path(parent.dir, "runner.sock").exists() and Path(parent.dir, "ready").exists()
    assert stdout_of(parent.run("print('fine')")) == "fine\n"


# ------------------------------------------------------------ registration


def test_registration(monkeypatch):
    forkable = tempfile.mkdtemp(prefix="skr-fk-", dir="/tmp")
    monkeypatch.setenv("SANDBOX_FORKABLE_DIR", forkable)
    parent = Daemon(plain=True)
    child = None
    try:
        entry = Path(forkable, "%d.json" % parent.proc.pid)
        assert json.loads(entry.read_text()) == {"pid": parent.proc.pid,
                                                 "socket": os.path.join(parent.dir, "runner.sock")}
        child = fork_to_new_dir(parent)
        child_entry = Path(forkable, "%d.json" % child.pid)
        assert json.loads(child_entry.read_text()) == {"pid": child.pid,
                                                       "socket": os.path.join(child.dir, "runner.sock")}
        assert entry.exists()
        # The agent's protocol: one JSON line, one JSON line back.
        import socket
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(json.loads(child_entry.read_text())["socket"])
            sock.sendall(b'{"op": "info"}\n')
            assert json.loads(sock.makefile().readline())["pid"] == child.pid
        child.stop()
        assert not child_entry.exists() and entry.exists()
        parent.stop()
        assert not entry.exists()
        assert os.listdir(forkable) == []
    finally:
        if child is not None:
            child.stop()
        parent.stop()
        shutil.rmtree(forkable, ignore_errors=True)


# ---------------------------------------------------------- namespace join

TARGET = textwrap.dedent(r"""
    import ctypes, os, sys, time
    libc = ctypes.CDLL(None, use_errno=True)
    CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWNET = (
        0x00020000, 0x04000000, 0x08000000, 0x10000000, 0x40000000)
    MS_REC, MS_PRIVATE = 0x4000, 1 << 18
    uid, gid = os.getuid(), os.getgid()
    def check(result, what):
        if result != 0:
            print("FAILED %s: %s" % (what, os.strerror(ctypes.get_errno())), flush=True)
            sys.exit(1)
    check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWNET), "unshare")
    with open("/proc/self/setgroups", "w") as f: f.write("deny")
    with open("/proc/self/uid_map", "w") as f: f.write("%d %d 1" % (uid, uid))
    with open("/proc/self/gid_map", "w") as f: f.write("%d %d 1" % (gid, gid))
    name = b"forked-target"
    check(libc.sethostname(name, len(name)), "sethostname")
    check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
    # The new sandbox's own (empty) copy of the daemon's directory.
    check(libc.mount(b"tmpfs", sys.argv[1].encode(), b"tmpfs", 0, b"mode=0700"), "mount tmpfs")
    print("READY", flush=True)
    time.sleep(120)
""")


def test_fork_into_namespaces():
    parent = Daemon(plain=False)
    target = subprocess.Popen([sys.executable, "-c", TARGET, parent.dir], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    child = None
    try:
        line = target.stdout.readline()
        if not line.startswith("READY"):
            pytest.skip("cannot create user/mount/uts/ipc/net namespaces here: %s" % line.strip())
        # A working directory of the cell's choosing, which the target's mount namespace has too.
        workdir = os.path.dirname(parent.dir)
        parent.run("secret = 42\nimport os, socket\nos.chdir(%r)" % workdir)
        reply = parent.request({"op": "fork", "join_pid": target.pid, "dir": None})
        assert reply.get("ok") is True, (reply, parent.log_text())
        # The child serves at the same path, in the target's mount namespace.
        child = Forked("/proc/%d/root%s" % (target.pid, parent.dir), reply["child_pid"], plain=False)
        assert child.ready["pid"] == reply["child_pid"]
        events = child.run("print(secret, socket.gethostname(), [n for _, n in socket.if_nameindex()])")
        assert stdout_of(events) == "42 forked-target ['lo']\n", (events, child.log_text())
        assert stdout_of(child.run("print(os.getcwd() == %r)" % workdir)) == "True\n"
        # The parent keeps its own namespaces, socket and state.
        assert Path(parent.dir, "runner.sock").exists()
        events = parent.run("print(secret, socket.gethostname() != 'forked-target', len(socket.if_nameindex()) >= 1)")
        assert stdout_of(events) == "42 True True\n"
    finally:
        if child is not None:
            try:
                child.command("request", {"op": "shutdown"}, timeout=10)
            except subprocess.TimeoutExpired:
                pass
            deadline = time.monotonic() + 5
            while child.alive() and time.monotonic() < deadline:
                time.sleep(0.02)
            if child.alive():
                os.kill(child.pid, signal.SIGKILL)
        target.kill()
        target.wait()
        parent.stop()
