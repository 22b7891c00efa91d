"""Managed processes (createos-api.md §15.3) and exec stdin/env (§15.2), driven by the
vendor's own Python SDK (`createos-sandbox`, unchanged) against the real local engine."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from createos import Client
from createos.errors import APIError
from createos.instance import SandboxInstance
from createos.models import (
    CreateSandboxRequest,
    ExecOptions,
    ManagedProcessConnectOptions,
    ManagedProcessCreateRequest,
    ManagedProcessDeleteOptions,
    ManagedProcessSignal,
    ManagedProcessState,
    ManagedProcessWaitOptions,
    ManagedProcessWaitScope,
    PTYSize,
    RunCommandRequest,
)

from engine_helpers import running_engine, start_engine, stop_process
from sandbox_kernel.guest.agent.processes import WINDOW_BYTES
from sandbox_kernel.local.service import EngineEndpoint


@pytest.fixture(scope="module")
def vendor(engine: EngineEndpoint) -> Iterator[Client]:
    client = Client(api_key=engine.token, base_url=engine.url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def sandbox(vendor: Client) -> Iterator[SandboxInstance]:
    box = vendor.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-1gb", environment_variables={"WHO": "box"}))
    yield box
    box.destroy()


def python(code: str, **kwargs) -> ManagedProcessCreateRequest:
    return ManagedProcessCreateRequest(command="python3", arguments=["-u", "-c", code], **kwargs)


def read_until(stream, marker: bytes, limit: float = 30) -> tuple[bytes, list]:
    """Data frames' bytes until `marker` appears (or an exit), and the frames read."""
    data, frames = b"", []
    deadline = time.monotonic() + limit
    for event in stream:
        frames.append(event)
        data += event.data
        if marker in data or event.type == "exit" or time.monotonic() > deadline:
            break
    return data, frames


def test_exec_honours_stdin_and_env(sandbox: SandboxInstance) -> None:
    result = sandbox.run_command(RunCommandRequest(command="cat"), ExecOptions(standard_input="x\ny")).result
    assert (result.standard_output, result.exit_code) == ("x\ny", 0)
    result = sandbox.run_command(
        RunCommandRequest(command="sh", arguments=["-c", "echo $WHO $EXTRA"]),
        ExecOptions(environment_variables={"EXTRA": "more", "WHO": "me"})).result
    assert result.standard_output == "me more\n"
    with sandbox.stream_command(RunCommandRequest(command="wc", arguments=["-c"]),
                                ExecOptions(standard_input="a" * 300_000)) as events:
        assert "300000" in "".join(e.data for e in events if e.type == "stdout")


def test_pipe_process_input_output_and_replay(sandbox: SandboxInstance) -> None:
    procs = sandbox.processes
    started = procs.create(python(
        "import sys\nfor line in sys.stdin: print('got', line.strip(), flush=True)\nprint('bye')",
        environment_variables={"WHO": "proc"}))
    assert started.state == ManagedProcessState.RUNNING and started.kind == "process" and started.pid > 0
    assert procs.input(started.process_id, "one\n") == 1
    with procs.connect(started.process_id) as stream:
        data, frames = read_until(stream, b"got one\n")
    assert data == b"got one\n" and frames[0].sequence == 1 and frames[0].stream == "stdout"
    # Disconnected: the process lives on, and what it says meanwhile is kept.
    assert procs.input(started.process_id, "two\n") == 2
    assert procs.input(started.process_id, "three\n") == 3
    procs.close_standard_input(started.process_id)
    assert procs.wait(started.process_id, ManagedProcessWaitOptions(
        scope=ManagedProcessWaitScope.TREE, wait_timeout=20)).tree_exited
    last = frames[-1].sequence
    with procs.connect(started.process_id, ManagedProcessConnectOptions(after_sequence=last)) as stream:
        events = list(stream)
    assert b"".join(e.data for e in events) == b"got two\ngot three\nbye\n"  # no loss, no duplicate
    assert [e.sequence for e in events if e.type == "data"][0] == last + 1
    assert events[-1].type == "exit" and events[-1].exit_code == 0
    assert all(e.oldest_available_sequence == 0 for e in events)
    # Replay from the start after the end: everything, then exit.
    with procs.connect(started.process_id) as stream:
        assert b"".join(e.data for e in stream).startswith(b"got one\ngot two")
    finished = procs.get(started.process_id)
    assert finished.state == ManagedProcessState.EXITED and finished.tree_exited and finished.exit_code == 0
    assert finished.finished_at is not None and finished.output.newest_sequence >= 2
    assert started.process_id in [p.process_id for p in procs.list()]


def pipes_held_by(pid: int) -> set[str]:
    """The pipes a host process has open, as /proc names them (pipe:[inode])."""
    held = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            if (target := os.readlink(f"/proc/{pid}/fd/{fd}")).startswith("pipe:"):
                held.add(target)
    return held


def stdin_of(marker: str) -> str:
    """The pipe read as stdin by the sandbox process whose command line holds `marker`."""
    for entry in os.scandir("/proc"):
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and marker.encode() in Path(entry.path, "cmdline").read_bytes():
                return os.readlink(f"{entry.path}/fd/0")
    raise LookupError(f"no process with {marker} in its command line")


def stdin_readers(pipe: str) -> list[int]:
    """The host pids of the processes whose stdin is `pipe`."""
    readers = []
    for entry in os.scandir("/proc"):
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and os.readlink(f"{entry.path}/fd/0") == pipe:
                readers.append(int(entry.name))
    return readers


def gone(pid: int) -> bool:
    """Exited (a zombie, whose parent has not waited for it yet, counts)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def echo_process(marker: str) -> ManagedProcessCreateRequest:
    return python(f"import sys  # {marker}\nfor line in sys.stdin: print('got', line.strip(), flush=True)")


def test_the_engine_writes_a_pipe_process_input_itself(engine: EngineEndpoint, sandbox: SandboxInstance) -> None:
    """From its first input on, a pipe process's stdin is written by the engine, which holds
    the pipe (the agent shares it: local/direct_input.py), one process less on a cell's way
    in. Nothing else changes: input_seq counts on, the order holds, closing stdin reaches the
    process, input after that is refused."""
    procs = sandbox.processes
    marker = "stdin-" + uuid.uuid4().hex
    started = procs.create(echo_process(marker))
    held_before = pipes_held_by(engine.pid)
    assert procs.input(started.process_id, "1\n") == 1
    stdin = stdin_of(marker)
    assert stdin not in held_before and stdin in pipes_held_by(engine.pid)
    for n in range(2, 41):
        assert procs.input(started.process_id, f"{n}\n") == n
    procs.close_standard_input(started.process_id)
    assert stdin not in pipes_held_by(engine.pid)
    assert procs.wait(started.process_id, ManagedProcessWaitOptions(
        scope=ManagedProcessWaitScope.TREE, wait_timeout=20)).exit_code == 0  # it read EOF
    with procs.connect(started.process_id) as stream:
        assert b"".join(e.data for e in stream) == b"".join(b"got %d\n" % n for n in range(1, 41))
    with pytest.raises(APIError) as closed:
        procs.input(started.process_id, "late\n")
    assert closed.value.status_code == 409


def test_input_after_the_leader_exits_is_refused_while_a_child_holds_stdin(
        engine: EngineEndpoint, sandbox: SandboxInstance) -> None:
    """The agent ends the engine's share of a stdin as the leader exits: input is refused
    (409) from then on, as before, though a child still holds the pipe it would go into."""
    procs = sandbox.processes
    marker = "stdin-" + uuid.uuid4().hex
    started = procs.create(python(
        f"import subprocess, sys  # {marker}\n"
        "child = subprocess.Popen(['sleep', '300'])  # inherits stdin, and stays\n"
        "sys.stdin.readline()\n"))
    stdin = stdin_of(marker)  # the leader waits for its line
    assert procs.input(started.process_id, "first\n") == 1  # shared: the leader reads it and exits
    assert stdin in pipes_held_by(engine.pid)
    assert procs.wait(started.process_id, ManagedProcessWaitOptions(
        scope=ManagedProcessWaitScope.LEADER, wait_timeout=20)).leader_exited
    assert stdin_readers(stdin)  # the child: a write to the pipe would still succeed
    with pytest.raises(APIError) as late:
        procs.input(started.process_id, "second\n")
    assert late.value.status_code == 409 and "exited" in str(late.value)
    assert stdin not in pipes_held_by(engine.pid)
    assert procs.delete(started.process_id).tree_exited


def test_input_seq_counts_on_after_the_engine_that_shared_stdin_stopped(tmp_path: Path) -> None:
    """The agent takes the input_seq the engine reports for the writes it made through its
    share: the engine that takes over from a stopped one (its sandboxes run on) numbers input
    on from there, and writes it itself again. (One killed within REPORT_DELAY of a write
    leaves the agent's count behind by that write: direct_input.py.)"""
    marker = "stdin-" + uuid.uuid4().hex
    with running_engine(tmp_path) as first:
        with Client(api_key=first.token, base_url=first.url) as vendor:
            box = vendor.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-512mb"))
            started = box.processes.create(echo_process(marker))
            for n in range(1, 4):
                assert box.processes.input(started.process_id, f"{n}\n") == n
        os.kill(first.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while not gone(first.pid):
            assert time.monotonic() < deadline, "the engine did not stop"
            time.sleep(0.02)
        process, second = start_engine(tmp_path, {})
        try:
            with Client(api_key=second.token, base_url=second.url) as vendor:
                again = vendor.get_sandbox(box.id)
                for n in range(4, 7):
                    assert again.processes.input(started.process_id, f"{n}\n") == n
                assert stdin_of(marker) in pipes_held_by(second.pid)
                with again.processes.connect(started.process_id) as stream:
                    data, _ = read_until(stream, b"got 6\n")
                assert data == b"".join(b"got %d\n" % n for n in range(1, 7))
                again.destroy()
        finally:
            stop_process(process, 15)


def test_env_cwd_and_stderr(sandbox: SandboxInstance) -> None:
    procs = sandbox.processes
    started = procs.create(ManagedProcessCreateRequest(
        command="sh", arguments=["-c", "echo $WHO $EXTRA; pwd; echo oops >&2; exit 3"],
        working_directory="/tmp", environment_variables={"EXTRA": "x"}))
    with procs.connect(started.process_id) as stream:
        events = list(stream)
    out = b"".join(e.data for e in events if e.stream == "stdout")
    assert out == b"box x\n/tmp\n"
    assert b"".join(e.data for e in events if e.stream == "stderr") == b"oops\n"
    assert events[-1].type == "exit" and events[-1].exit_code == 3
    assert procs.get(started.process_id).working_directory == "/tmp"


def test_pty_resize_and_keystrokes(sandbox: SandboxInstance) -> None:
    procs = sandbox.processes
    started = procs.create(ManagedProcessCreateRequest(pty=PTYSize(rows=30, cols=100)))  # a default shell
    assert started.kind == "pty"
    procs.input(started.process_id, "stty size\n")
    with procs.connect(started.process_id) as stream:
        data, frames = read_until(stream, b"30 100")
        assert b"30 100" in data and frames[0].stream == "pty"
        procs.resize(started.process_id, PTYSize(rows=40, cols=120))
        procs.input(started.process_id, "stty size; tty\n")
        data, _ = read_until(stream, b"/dev/pts")
        assert b"40 120" in data
    foreground = procs.get(started.process_id).foreground
    assert foreground is not None and foreground.process_id > 0
    procs.input(started.process_id, "exit 7\n")
    assert procs.wait(started.process_id, ManagedProcessWaitOptions(wait_timeout=20)).exit_code == 7


def test_python_reading_a_tty_and_ctrl_c(sandbox: SandboxInstance) -> None:
    procs = sandbox.processes
    started = procs.create(ManagedProcessCreateRequest(
        command="python3", arguments=["-c", "import os,sys; print('tty', os.isatty(0)); input('? ');"
                                      "import time; print('sleeping', flush=True); time.sleep(60)"],
        pty=PTYSize(rows=24, cols=80)))
    with procs.connect(started.process_id) as stream:
        data, _ = read_until(stream, b"? ")
        assert b"tty True" in data
        procs.input(started.process_id, "hi\n")
        read_until(stream, b"sleeping")
        procs.signal(started.process_id, ManagedProcessSignal.INTERRUPT)
        data, frames = read_until(stream, b"never")
    assert b"KeyboardInterrupt" in data and frames[-1].type == "exit"


def test_window_overflow_gives_oldest_available_seq(sandbox: SandboxInstance) -> None:
    procs = sandbox.processes
    lines = 2 * WINDOW_BYTES // 8001  # twice what is kept
    started = procs.create(python(f"import sys\nfor i in range({lines}): sys.stdout.write(str(i).rjust(8) * 1000 + '\\n')"))
    waited = procs.wait(started.process_id, ManagedProcessWaitOptions(wait_timeout=30))
    assert waited.leader_exited
    window = procs.get(started.process_id).output
    assert window.oldest_sequence > 1 and window.bytes <= WINDOW_BYTES
    with procs.connect(started.process_id) as stream:
        events = list(stream)
    assert events[0].oldest_available_sequence == events[0].sequence == window.oldest_sequence
    assert all(e.oldest_available_sequence == 0 for e in events[1:])
    assert b"".join(e.data for e in events).endswith(str(lines - 1).rjust(8).encode() * 1000 + b"\n")
    assert events[-1].type == "exit"


def test_kill_with_grace_ends_a_term_trapping_tree(sandbox: SandboxInstance) -> None:
    procs = sandbox.processes
    script = ("trap 'echo term; exit 0' TERM; (trap '' TERM; sleep 300) & "
              "echo up; while :; do sleep 0.1; done")
    started = procs.create(ManagedProcessCreateRequest(command="bash", arguments=["-c", script]))
    with procs.connect(started.process_id) as stream:
        read_until(stream, b"up")
    # The grace is spent in full (the child ignores TERM); long enough for a loaded machine.
    killed = procs.delete(started.process_id, ManagedProcessDeleteOptions(grace_period=5))
    assert killed.leader_exited and killed.tree_exited and killed.state == ManagedProcessState.EXITED
    assert killed.exit_code == 0  # the leader trapped TERM; the child ignoring it got SIGKILL
    with procs.connect(started.process_id) as stream:
        assert b"term" in b"".join(e.data for e in stream)
    # Without grace: SIGKILL at once.
    started = procs.create(ManagedProcessCreateRequest(command="sleep", arguments=["300"]))
    killed = procs.delete(started.process_id)
    assert killed.tree_exited and killed.signal == "SIGKILL" and killed.exit_code == 137


def test_wait_leader_versus_tree(sandbox: SandboxInstance) -> None:
    procs = sandbox.processes
    go = "/tmp/tree-may-end-%d" % time.monotonic_ns()
    started = procs.create(ManagedProcessCreateRequest(command="sh", arguments=[
        "-c", "(while [ ! -e %s ]; do sleep 0.05; done) </dev/null >/dev/null 2>&1 & exit 0" % go]))
    leader = procs.wait(started.process_id, ManagedProcessWaitOptions(scope=ManagedProcessWaitScope.LEADER,
                                                                      wait_timeout=20))
    assert leader.leader_exited and not leader.tree_exited
    timed_out = procs.wait(started.process_id, ManagedProcessWaitOptions(scope=ManagedProcessWaitScope.TREE,
                                                                         wait_timeout=0.05))
    assert not timed_out.tree_exited
    sandbox.run_command(RunCommandRequest(command="touch", arguments=[go]))
    tree = procs.wait(started.process_id, ManagedProcessWaitOptions(scope=ManagedProcessWaitScope.TREE,
                                                                    wait_timeout=20))
    assert tree.tree_exited


def test_a_blocked_call_holds_up_no_other(sandbox: SandboxInstance) -> None:
    """The engine keeps connections to the agent for process calls: one held by a `wait`
    must not make the calls after it queue behind it."""
    procs = sandbox.processes
    started = procs.create(python("import sys\nfor line in sys.stdin: print('got', line.strip(), flush=True)"))
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        waits = [pool.submit(procs.wait, started.process_id, ManagedProcessWaitOptions(
            scope=ManagedProcessWaitScope.LEADER, wait_timeout=60)) for _ in range(2)]
        time.sleep(0.5)  # both waits are in the agent now (a wait is answered only at the exit)
        assert not any(wait.done() for wait in waits)
        for n in range(5):
            assert procs.input(started.process_id, "line %d\n" % n) == n + 1
            assert procs.get(started.process_id).state == ManagedProcessState.RUNNING
        with procs.connect(started.process_id) as stream:
            data, _ = read_until(stream, b"got line 4\n")
        assert data == b"".join(b"got line %d\n" % n for n in range(5))
        assert not any(wait.done() for wait in waits)
        procs.close_standard_input(started.process_id)
        assert all(wait.result(timeout=30).leader_exited for wait in waits)


def test_errors(sandbox: SandboxInstance) -> None:
    procs = sandbox.processes
    with pytest.raises(APIError) as missing:
        procs.get("proc-nope")
    assert missing.value.status_code == 404
    with pytest.raises(APIError) as unstartable:
        procs.create(ManagedProcessCreateRequest(command="/no/such/binary"))
    assert unstartable.value.status_code == 400
    started = procs.create(ManagedProcessCreateRequest(command="true"))
    procs.wait(started.process_id, ManagedProcessWaitOptions(scope=ManagedProcessWaitScope.TREE, wait_timeout=20))
    with pytest.raises(APIError) as late:
        procs.input(started.process_id, "x")
    assert late.value.status_code == 409
    with pytest.raises(APIError) as not_a_pty:
        procs.resize(started.process_id, PTYSize(rows=10, cols=10))
    assert not_a_pty.value.status_code == 400


def test_pause_resume_keeps_the_process_and_its_stream(vendor: Client) -> None:
    box = vendor.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-512mb"))
    try:
        procs = box.processes
        started = procs.create(python(
            "import sys, time\nfor line in sys.stdin: print('echo', line.strip(), flush=True)"))
        with procs.connect(started.process_id) as stream:
            procs.input(started.process_id, "before\n")
            read_until(stream, b"echo before")
            box.pause()
            box.wait_until_paused()
            with pytest.raises(APIError) as frozen:
                procs.input(started.process_id, "x\n")
            assert frozen.value.status_code == 409
            box.resume()
            box.wait_until_running()
            procs.input(started.process_id, "after\n")
            data, _ = read_until(stream, b"echo after")  # the same stream, still open
            assert b"echo after" in data
        assert procs.get(started.process_id).state == ManagedProcessState.RUNNING
        with procs.connect(started.process_id) as stream:
            procs_id = started.process_id
            box.destroy()  # destroy ends the process: the stream gets an error and ends
            events = list(stream)
        assert events[-1].type == "error" and "ended" in events[-1].error_message
        with pytest.raises(APIError):
            procs.get(procs_id)
    finally:
        try:
            box.destroy()
        except APIError:
            pass


def test_fork_starts_with_an_empty_table(vendor: Client) -> None:
    box = vendor.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-512mb"))
    try:
        started = box.processes.create(ManagedProcessCreateRequest(command="sleep", arguments=["300"]))
        box.pause()
        box.wait_until_paused()
        child = box.fork()
        child.wait_until_running()
        try:
            assert child.processes.list() == []
            box.resume()
            box.wait_until_running()
            assert box.processes.get(started.process_id).state == ManagedProcessState.RUNNING
        finally:
            child.destroy()
    finally:
        box.destroy()


def test_large_input_and_exec_stdin(sandbox: SandboxInstance) -> None:
    """Both travel to the agent as raw bytes, not inside its 1 MiB request line."""
    procs = sandbox.processes
    started = procs.create(ManagedProcessCreateRequest(command="wc", arguments=["-c"]))
    procs.input_bytes(started.process_id, b"\0\xff" * (3 << 20))
    procs.close_standard_input(started.process_id)
    with procs.connect(started.process_id) as stream:
        assert b"".join(e.data for e in stream).strip() == str(6 << 20).encode()
    result = sandbox.run_command(RunCommandRequest(command="wc", arguments=["-c"]),
                                 ExecOptions(standard_input="z" * (3 << 20))).result
    assert result.standard_output.strip() == str(3 << 20)


def test_table_bounds(vendor: Client) -> None:
    box = vendor.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-512mb"))
    try:
        procs = box.processes
        with pytest.raises(APIError) as too_long:
            procs.create(ManagedProcessCreateRequest(command="echo", arguments=["x" * 70_000]))
        assert too_long.value.status_code == 400
        sleepers = [procs.create(ManagedProcessCreateRequest(command="sleep", arguments=["300"]))
                    for _ in range(32)]
        with pytest.raises(APIError) as full:
            procs.create(ManagedProcessCreateRequest(command="true"))
        assert full.value.status_code == 409
        procs.delete(sleepers[0].process_id)  # an exited process makes room
        procs.create(ManagedProcessCreateRequest(command="true"))
        listed = [p.process_id for p in procs.list()]
        assert len(listed) == 32 and sleepers[0].process_id not in listed
    finally:
        box.destroy()


def test_exit_frame_despite_an_escaped_pipe_holder(sandbox: SandboxInstance) -> None:
    """A child that left the session keeps stdout open for ever: the exit frame still
    comes once the tree is gone, and what the child writes later is still kept."""
    procs = sandbox.processes
    started = procs.create(ManagedProcessCreateRequest(
        command="sh", arguments=["-c", "setsid sh -c 'sleep 1; echo late; sleep 300' & echo hi"]))
    with procs.connect(started.process_id, ManagedProcessConnectOptions(timeout=20)) as stream:
        events = list(stream)
    assert b"".join(e.data for e in events).startswith(b"hi\n")
    assert events[-1].type == "exit" and events[-1].exit_code == 0
    deadline = time.monotonic() + 20
    while procs.get(started.process_id).output.bytes < len(b"hi\nlate\n"):
        assert time.monotonic() < deadline, "the escaped child's output was not kept"
        time.sleep(0.1)
