"""Managed processes (CreateOS §15.3) inside the sandbox: the table, output windows, stdin.

The table lives in the agent, not in the engine: it survives an engine restart (the
engine is a thin proxy that re-reads it), and the memory it holds is charged to the
sandbox's own cgroup. Stdlib only, like agent.py (pybase64 encodes output where the
environment has it: _output_encoder).

What a client can rely on:
- A process starts in its own session (pipes: stdin/stdout/stderr; PTY: one terminal,
  merged output stream "pty"). It outlives every connection: only kill, its own exit or
  the end of the sandbox stop it.
- Output is numbered: one `seq` per chunk read, from 1. Each process keeps the newest
  WINDOW_BYTES of it (each chunk also costs CHUNK_OVERHEAD, so many tiny chunks cannot
  outgrow the bound). `connect after=N` replays the retained chunks with seq > N, then
  follows live ones; the first frame after a gap carries `oldest_available_seq`. A slow
  reader never slows the process: it skips ahead (with a gap) instead.
- The `exit` frame comes once the leader has exited and its output is at EOF, or its
  whole tree is gone (a process that left the tree may hold the pipes for ever: what it
  writes later is still kept, after the exit frame). Its seq is the last data frame's
  when sent. Killed by signal N: exit_code 128+N and `signal` its name.
- The tree is the leader's session (in this sandbox's mount namespace): a process that
  calls setsid() leaves it. The leader stays a zombie until its tree is gone, so its pid
  (the session id) cannot be reused meanwhile.
- kill: SIGTERM to the tree, SIGKILL after grace_ms (at once without); answered once the
  tree is gone. signal: to the leader's process group (PTY: the terminal's foreground
  job, as a key would), also only in this mount namespace. Input is serialized; `input_seq` counts writes from 1.
- A pipe process's stdin can be shared with the engine (agent.py, process_stdin_share),
  which then writes its input itself, one process less on a cell's way in, and reports
  the process's `input_seq` a little after its writes and as the share ends, so that the
  count goes on here. The share ends when the leader exits, when the engine hangs up, or
  when the agent goes.
- At most MAX_PROCESSES in the table; the oldest exited ones are dropped to make room.
- Pause freezes these processes with the agent; their windows and streams stay intact.
  A fork starts with an empty table (a fresh agent).
"""

from __future__ import annotations

import asyncio
import binascii
import collections
import contextlib
import fcntl
import functools
import itertools
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable

# Retained output per process: the runner writes a channel at most protocol.CHANNEL_WINDOW
# (7.5 MiB) ahead of the kernel's acknowledgements, which must stay within it. Charged to
# the sandbox's memory (at most MAX_PROCESSES windows), and only as far as a process's
# output fills it. 8 MiB, not 4: half as many acknowledgements in a long print, each an API
# call through kernel, engine and agent (a 20 MiB print: kernel CPU 322 -> 282 ms and
# 10 % more throughput, side by side).
WINDOW_BYTES = 8 << 20
CHUNK_OVERHEAD = 128  # bytes each retained chunk is charged beyond its data (deque slot, bytes object)
MAX_PROCESSES = 32
MAX_COMMAND_LINE = 64 * 1024  # cmd + args + cwd, in characters: every description repeats them
# One read, one frame: fewer, larger frames are less work per byte for the agent, the
# engine and the kernel (a long print went from ~330 frames per 20 MiB to ~100). The
# stdout pipe is enlarged to match (best effort: the per-user pipe budget may refuse).
READ_CHUNK = 256 * 1024
REPLAY_BATCH = 64  # frames written before a subscriber looks at the window again
TREE_POLL_MIN, TREE_POLL_MAX = 0.05, 1.0
DEFAULT_PTY_SIZE = (24, 80)
SIGNALS = {name: getattr(signal, name) for name in (
    "SIGHUP", "SIGINT", "SIGQUIT", "SIGKILL", "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGWINCH")}


class ProcessError(Exception):
    """A request the table refuses; `code` is not_found, invalid or conflict (busy: a
    stdin share to ask for again later)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def rfc3339(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + ".%06dZ" % int(ts % 1 * 1e6)


class OutputWindow:
    """The newest output chunks of one process, bounded in bytes; seqs are contiguous."""

    def __init__(self) -> None:
        self.chunks: collections.deque = collections.deque()  # (seq, stream, data)
        self.newest_seq = 0
        self.bytes = 0
        self._cost = 0

    @property
    def oldest_seq(self) -> int:
        return self.chunks[0][0] if self.chunks else self.newest_seq

    def append(self, stream: str, data: bytes) -> None:
        self.newest_seq += 1
        self.chunks.append((self.newest_seq, stream, data))
        self.bytes += len(data)
        self._cost += len(data) + CHUNK_OVERHEAD
        while self._cost > WINDOW_BYTES and len(self.chunks) > 1:
            _, _, dropped = self.chunks.popleft()
            self.bytes -= len(dropped)
            self._cost -= len(dropped) + CHUNK_OVERHEAD

    def after(self, seq: int) -> list:
        """Up to REPLAY_BATCH retained chunks with seq > `seq`, oldest first."""
        if not self.chunks:
            return []
        start = max(0, seq + 1 - self.chunks[0][0])
        return list(itertools.islice(self.chunks, start, start + REPLAY_BATCH))

    def describe(self) -> dict:
        return {"oldest_seq": self.oldest_seq, "newest_seq": self.newest_seq, "bytes": self.bytes}


class ManagedProcess:
    def __init__(self, kind: str, cmd: str, args: list, cwd: str, popen: subprocess.Popen,
                 outputs: dict, stdin_fd: int | None, master_fd: int | None) -> None:
        # secrets.token_hex(8) is os.urandom(8).hex(); the secrets module would also load
        # hashlib (OpenSSL) and random into every sandbox's agent.
        self.id = "proc-" + os.urandom(8).hex()
        self.kind, self.cmd, self.args, self.cwd = kind, cmd, args, cwd
        self.popen = popen
        self.pid = popen.pid
        self.created_at = time.time()
        self.finished_at: float | None = None
        self.state = "running"
        self.exit_code: int | None = None
        self.signal: str | None = None
        self.leader_exited = False
        self.tree_exited = False
        self.window = OutputWindow()
        self.open_outputs = dict(outputs)  # fd -> stream name, until EOF
        self.stdin_fd = stdin_fd  # pipes: our end of its stdin; PTY: the master
        self.master_fd = master_fd
        self.input_seq = 0
        self.input_lock = asyncio.Lock()
        # The engine's connection while it shares stdin_fd and writes it itself (agent.py).
        self.stdin_share: asyncio.StreamWriter | None = None
        self._changed = asyncio.get_running_loop().create_future()

    # -- events -----------------------------------------------------------------------

    def next_change(self) -> asyncio.Future:
        """Done at the next change (output, exit, tree exit) after this call. Shielded: one
        waiter's cancellation must not cancel the future all the others share. A plain
        function, so the future is taken now: as a coroutine it was taken at its first step,
        which asyncio.wait_for (Python 3.11) runs a loop turn later, and a change in between
        left the waiter on the next future, asleep until its timeout."""
        return asyncio.shield(self._changed)

    def notify(self) -> None:
        self._changed.set_result(None)
        self._changed = asyncio.get_running_loop().create_future()

    @property
    def finished(self) -> bool:
        """The exit frame is due: the leader exited, and its output is at EOF or its whole
        tree is gone (a process that left the tree may keep the pipes open for ever)."""
        return self.leader_exited and (not self.open_outputs or self.tree_exited)

    def describe(self) -> dict:
        return {"process_id": self.id, "kind": self.kind, "pid": self.pid, "state": self.state,
                "leader_exited": self.leader_exited, "tree_exited": self.tree_exited,
                "created_at": rfc3339(self.created_at),
                "finished_at": rfc3339(self.finished_at) if self.finished_at else None,
                "exit_code": self.exit_code, "signal": self.signal, "cmd": self.cmd,
                "args": self.args, "cwd": self.cwd, "foreground": self.foreground(),
                "output": self.window.describe()}

    def foreground(self) -> dict | None:
        if self.master_fd is None or self.leader_exited:
            return None
        try:
            pgid = os.tcgetpgrp(self.master_fd)
            with open("/proc/%d/cmdline" % pgid, "rb") as source:
                argv = [a.decode(errors="replace") for a in source.read().split(b"\0")[:-1]]
        except OSError:
            return None
        return {"pid": pgid, "cmd": argv[0] if argv else "", "args": argv[1:]}

    def exit_frame(self) -> dict:
        return {"type": "exit", "seq": self.window.newest_seq, "exit_code": self.exit_code,
                "signal": self.signal}


class ProcessTable:
    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self.processes: dict = {}  # id -> ManagedProcess, in creation order

    def get(self, process_id) -> ManagedProcess:
        process = self.processes.get(process_id)
        if process is None:
            raise ProcessError("not_found", "process not found")
        return process

    # -- create -----------------------------------------------------------------------

    def create(self, request: dict, preexec) -> ManagedProcess:
        """Start a process; `preexec` runs in the child before exec (the agent's OOM setting)."""
        cmd, args = request.get("cmd") or "", request.get("args") or []
        env = dict(os.environ)
        env.update(request.get("env") or {})
        cwd = request.get("cwd") or self.workdir
        pty_size = request.get("pty")
        if not isinstance(cmd, str) or not all(isinstance(a, str) for a in args):
            raise ProcessError("invalid", "cmd and args must be strings")
        if len(cmd) + sum(map(len, args)) + len(cwd) > MAX_COMMAND_LINE:
            raise ProcessError("invalid", "cmd, args and cwd together exceed %d characters" % MAX_COMMAND_LINE)
        if not cmd:
            if pty_size is None:
                raise ProcessError("invalid", "cmd is required for a process without a pty")
            cmd = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
        self._make_room()
        try:
            if pty_size is not None:
                process = self._spawn_pty(cmd, args, cwd, env, pty_size, preexec)
            else:
                process = self._spawn_pipes(cmd, args, cwd, env, preexec)
        except (OSError, ValueError, subprocess.SubprocessError) as exc:  # ValueError: a NUL, a lone surrogate
            raise ProcessError("invalid", "start %s: %s" % (cmd, getattr(exc, "strerror", None) or exc)) from None
        self.processes[process.id] = process
        loop = asyncio.get_running_loop()
        for fd in process.open_outputs:
            os.set_blocking(fd, False)
            loop.add_reader(fd, self._read_output, process, fd)
        threading.Thread(target=self._await_leader, args=(loop, process), daemon=True).start()
        return process

    def _make_room(self) -> None:
        if len(self.processes) < MAX_PROCESSES:
            return
        for process in list(self.processes.values()):
            if process.tree_exited:
                self._discard(process)
                return
        raise ProcessError("conflict", "too many managed processes (%d): kill some first" % MAX_PROCESSES)

    @staticmethod
    def _spawn_pipes(cmd: str, args: list, cwd: str, env: dict, preexec) -> ManagedProcess:
        stdin_r, stdin_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        with contextlib.suppress(OSError):
            fcntl.fcntl(out_w, fcntl.F_SETPIPE_SZ, READ_CHUNK)
        try:
            popen = subprocess.Popen([cmd, *args], stdin=stdin_r, stdout=out_w, stderr=err_w, cwd=cwd,
                                     env=env, start_new_session=True, preexec_fn=preexec)
        except BaseException:
            for fd in (stdin_w, out_r, err_r):
                os.close(fd)
            raise
        finally:
            for fd in (stdin_r, out_w, err_w):
                os.close(fd)
        os.set_blocking(stdin_w, False)
        return ManagedProcess("process", cmd, args, cwd, popen, {out_r: "stdout", err_r: "stderr"},
                              stdin_w, None)

    @staticmethod
    def _spawn_pty(cmd: str, args: list, cwd: str, env: dict, size: dict, preexec) -> ManagedProcess:
        master, slave = os.openpty()
        set_window_size(master, size.get("rows") or DEFAULT_PTY_SIZE[0], size.get("cols") or DEFAULT_PTY_SIZE[1])
        env.setdefault("TERM", "xterm-256color")

        def become_terminal_session() -> None:  # after setsid(): the pty becomes its terminal
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)
            preexec()

        try:
            popen = subprocess.Popen([cmd, *args], stdin=slave, stdout=slave, stderr=slave, cwd=cwd,
                                     env=env, start_new_session=True, preexec_fn=become_terminal_session)
        except BaseException:
            os.close(master)
            raise
        finally:
            os.close(slave)
        return ManagedProcess("pty", cmd, args, cwd, popen, {master: "pty"}, master, master)

    # -- output and exit --------------------------------------------------------------

    def _read_output(self, process: ManagedProcess, fd: int) -> bool:
        """Read once from `fd`; False when nothing more is there now (or ever)."""
        try:
            data = os.read(fd, READ_CHUNK)
        except BlockingIOError:
            return False
        except OSError:  # EIO: a pty whose last holder closed it
            data = b""
        if data:
            process.window.append(process.open_outputs[fd], data)
        else:
            self._close_output(process, fd)
        process.notify()
        return bool(data)

    @staticmethod
    def _close_output(process: ManagedProcess, fd: int) -> None:
        asyncio.get_running_loop().remove_reader(fd)
        del process.open_outputs[fd]
        if fd != process.master_fd:
            os.close(fd)
        release_fds(process)

    def _await_leader(self, loop: asyncio.AbstractEventLoop, process: ManagedProcess) -> None:
        """In a thread: wait for the leader's exit without reaping it (its pid stays taken)."""
        while True:
            try:
                info = os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)
                break
            except ChildProcessError:
                info = None
                break
            except InterruptedError:
                continue
        loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._leader_exited(process, info)))

    async def _leader_exited(self, process: ManagedProcess, info) -> None:
        process.leader_exited = True
        end_stdin_share(process)
        process.finished_at = time.time()
        if info is not None and info.si_code == os.CLD_EXITED:
            process.exit_code = info.si_status
        elif info is not None:
            process.exit_code = 128 + info.si_status
            process.signal = signal_name(info.si_status)
        if process.state != "terminating":
            process.state = "exited"
        if tree_members(process.pid):  # else leader and tree end in one change
            process.notify()
            delay = TREE_POLL_MIN
            while tree_members(process.pid):
                await asyncio.sleep(delay)
                delay = min(delay * 2, TREE_POLL_MAX)
        os.waitpid(process.pid, 0)  # the zombie leader goes: its tree is empty
        process.popen.returncode = process.exit_code  # reaped here, so Popen must never wait for it
        # What the tree wrote before it ended is in the pipes now: take it before the exit
        # frame falls due. A process that left the tree may hold them and write on: that
        # output is still kept (after the exit frame), and it gets no SIGPIPE from us.
        for fd in list(process.open_outputs):
            while fd in process.open_outputs and self._read_output(process, fd):
                pass
        process.tree_exited = True
        process.state = "exited"
        release_fds(process)
        process.notify()

    def _discard(self, process: ManagedProcess) -> None:
        """Drop an exited process from the table, with the pipes a stray writer may hold."""
        for fd in list(process.open_outputs):
            self._close_output(process, fd)
        del self.processes[process.id]

    # -- requests ---------------------------------------------------------------------

    async def write_input(self, process_id, chunks) -> int:
        """Write the async iterable `chunks` to the process's stdin, whole, before any later input."""
        process = self.get(process_id)
        async with process.input_lock:
            if process.leader_exited:
                raise ProcessError("conflict", "process has exited")
            if process.stdin_fd is None:
                raise ProcessError("conflict", "stdin is closed")
            process.input_seq += 1
            seq = process.input_seq
            try:
                async for chunk in chunks:
                    await write_all(process.stdin_fd, chunk)
            except OSError as exc:
                raise ProcessError("conflict", "stdin: %s" % (exc.strerror or exc)) from None
        return seq

    def shareable_stdin(self, process: ManagedProcess) -> int:
        """The write end of `process`'s stdin, if the engine may share it: a pipe process's
        whose leader runs, whose stdin is open and not shared already. Called holding the
        process's input_lock, so that no write of the agent's is under way."""
        if process.kind != "process":
            raise ProcessError("invalid", "only a pipe process's stdin can be shared")
        if process.leader_exited:
            raise ProcessError("conflict", "process has exited")
        if process.stdin_fd is None:
            raise ProcessError("conflict", "stdin is closed")
        if process.stdin_share is not None:  # with an engine that is gone, until its end is read
            raise ProcessError("busy", "stdin is shared already")
        return process.stdin_fd

    async def close_stdin(self, process_id) -> None:
        process = self.get(process_id)
        if process.kind == "pty":
            raise ProcessError("invalid", "a pty has no stdin to close: send ctrl-D (\\x04) as input")
        async with process.input_lock:  # after the writes already accepted
            if process.stdin_fd is not None:
                os.close(process.stdin_fd)
                process.stdin_fd = None

    def resize(self, process_id, rows, cols) -> None:
        process = self.get(process_id)
        if process.kind != "pty":
            raise ProcessError("invalid", "only a pty can be resized")
        if process.master_fd is None:
            raise ProcessError("conflict", "process has exited")
        if not all(isinstance(n, int) and 0 < n <= 1000 for n in (rows, cols)):
            raise ProcessError("invalid", "rows and cols must be 1..1000")
        set_window_size(process.master_fd, rows, cols)

    def send_signal(self, process_id, name) -> None:
        process = self.get(process_id)
        if name not in SIGNALS:
            raise ProcessError("invalid", "signal must be one of " + " ".join(SIGNALS))
        if process.leader_exited:
            raise ProcessError("conflict", "process has exited")
        group = process.pid  # its process group, as killpg would, but never a fork's copies
        if process.master_fd is not None:
            try:
                # 0 = no foreground job: then the leader's group.
                group = os.tcgetpgrp(process.master_fd) or process.pid
            except OSError:
                pass
        signal_each(processes_where(GROUP, group), SIGNALS[name])

    async def kill(self, process_id, grace_ms: int) -> ManagedProcess:
        process = self.get(process_id)
        if process.tree_exited:
            return process
        if grace_ms > 0:
            if not process.leader_exited:
                process.state = "terminating"
            signal_tree(process.pid, signal.SIGTERM)
            await self.wait(process, "tree", grace_ms)
        while not process.tree_exited:
            signal_tree(process.pid, signal.SIGKILL)
            await self.wait(process, "tree", 200)
        return process

    async def wait(self, process: ManagedProcess, scope: str, timeout_ms) -> ManagedProcess:
        deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
        while not (process.tree_exited if scope == "tree" else process.leader_exited):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            try:
                await asyncio.wait_for(process.next_change(), left)
            except asyncio.TimeoutError:
                break
        return process

    async def stream(self, process: ManagedProcess, after: int, send) -> None:
        """Send the frames after `after`, then live ones, then `exit`: `send` takes a frame's
        line (compact JSON, as agent.frame writes) and awaits its delivery."""
        cursor = after
        while True:
            window = process.window
            chunks = window.after(cursor)
            if chunks:
                gap = chunks[0][0] > cursor + 1
                for seq, stream, data in chunks:
                    await send(data_frame(seq, stream, data, seq if gap else None))
                    gap = False
                    cursor = seq
                continue
            if process.finished:
                await send(json.dumps(process.exit_frame(), separators=(",", ":")).encode() + b"\n")
                return
            await process.next_change()


def data_frame(seq: int, stream: str, data: bytes, oldest_available_seq: int | None) -> bytes:
    """A data frame's line, spelled out: base64 and our stream names need no JSON escaping,
    and json.dumps scanning each frame's base64 again was a third of the agent's time in a
    long print (the engine tells frames apart by this prefix: local/processes.py)."""
    gap = b',"oldest_available_seq":%d' % oldest_available_seq if oldest_available_seq is not None else b""
    return (b'{"type":"data","seq":%d,"stream":"%s","data_base64":"%s"%s}\n'
            % (seq, stream.encode(), _output_encoder()(data), gap))


def _stdlib_base64(data: bytes) -> bytes:
    return binascii.b2a_base64(data, newline=False)


@functools.lru_cache(maxsize=None)
def _output_encoder() -> Callable[[bytes], bytes]:
    """pybase64's encoder when the interpreter's environment has it (the engine's does): 15
    times binascii's speed, whose 2.3 ms per MiB was the agent's largest cost in a long print.
    Else, as on a bare rootfs, binascii's: the same bytes. The agent runs without site (-S),
    so the environment's site-packages is put on the path for this one import, after the
    standard library (it is read-only in the sandbox)."""
    environment = os.path.dirname(os.path.dirname(sys.executable))
    if os.path.exists(os.path.join(environment, "pyvenv.cfg")):  # a venv, which only site would see
        places = [os.path.join(environment, "lib", "python%d.%d" % sys.version_info[:2], "site-packages")]
    else:
        import site

        places = site.getsitepackages()
    added = [place for place in places if place not in sys.path]
    sys.path.extend(added)
    try:
        from pybase64 import b64encode
    except ImportError:
        return _stdlib_base64
    finally:
        for place in added:
            sys.path.remove(place)
    return b64encode


def end_stdin_share(process: ManagedProcess) -> None:
    """Hang up the engine's share of the process's stdin now, not at a later loop turn: input
    after the leader's exit is refused, and the engine must have heard of the end by the time
    anyone can have seen the exit."""
    if process.stdin_share is not None:
        with contextlib.suppress(OSError):
            process.stdin_share.get_extra_info("socket").shutdown(socket.SHUT_RDWR)


def release_fds(process: ManagedProcess) -> None:
    """Close its stdin and terminal once nothing can use them: tree gone, output at EOF."""
    if not process.tree_exited or process.open_outputs:
        return
    for fd in {process.stdin_fd, process.master_fd} - {None}:
        os.close(fd)
    process.stdin_fd = process.master_fd = None


def set_window_size(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


async def write_all(fd: int, data: bytes) -> None:
    """Write all of `data` to a non-blocking fd, waiting for room as the reader drains it."""
    loop = asyncio.get_running_loop()
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
            continue
        except BlockingIOError:
            pass
        room = loop.create_future()
        loop.add_writer(fd, room.set_result, None)
        try:
            await room
        finally:
            loop.remove_writer(fd)


GROUP, SESSION = 2, 3  # fields of /proc/<pid>/stat after the command's name


def processes_where(field: int, value: int) -> list:
    """Live processes of this mount namespace whose stat `field` is `value`. A fork shares
    the pid namespace, and its copies of our processes keep their group and session ids:
    they are the fork's, not ours, so neither trees nor signals may reach them."""
    mine = os.readlink("/proc/self/ns/mnt")
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name) as source:
                fields = source.read().rsplit(")", 1)[1].split()
            if int(fields[field]) != value or fields[0] == "Z":
                continue
            if os.readlink("/proc/%s/ns/mnt" % name) != mine:
                continue
        except (OSError, IndexError, ValueError):
            continue
        found.append(int(name))
    return found


def tree_members(session: int) -> list:
    """The live processes of the session (its leader too while it has not exited)."""
    return processes_where(SESSION, session)


def signal_each(pids: list, number: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, number)
        except ProcessLookupError:
            pass


def signal_tree(session: int, number: int) -> None:
    signal_each(tree_members(session), number)
