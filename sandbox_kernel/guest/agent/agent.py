"""The agent inside every local sandbox: spawns exec'd commands and moves files.

bwrap starts it (through run_agent.py) as the sandbox's main process (bwrap's own init
is PID 1 and reaps orphans; when this process exits, bwrap tears the whole sandbox down). It runs
with the sandbox's view of the world, so every path it touches is resolved *inside* the
sandbox: a symlink to /etc/passwd in an upload reaches the sandbox's own /etc/passwd,
never the host's. Stdlib only: it runs on the sandbox's Python, not the engine's.

Protocol (unix socket, one request per connection): the engine sends one JSON line,
    {"op": "ping"}
    {"op": "exec", "cmd": str, "args": [str], "env": {str: str}, "stdin_size": N}  + N bytes
    {"op": "write", "path": "/abs", "size"?: N}   then the raw bytes and EOF (a half-close);
                                                  with a size, fewer bytes are a failure
    {"op": "read", "path": "/abs"}
    {"op": "fork", "hostname": str, "disk_mib": N, "env": {str: str}}
    {"op": "egress_listen"}
    {"op": "egress_attach", "stream": N}
    {"op": "process_<create|list|get|kill|wait|input|stdin_close|resize|signal|connect>", ...}
    {"op": "process_stdin_share", "id": str}
    {"op": "signal_listen"}   (the sandbox's self-signals, see self_signal.py)
and gets back JSON lines. exec answers with CreateOS exec frames, one per line
({"stdout": s} / {"stderr": s} / {"error": s} / {"exit_code": n}); write answers
{"ok": true, "bytes": N}; read answers {"ok": true, "size": N} then N raw bytes;
fork answers {"ok": true, "pid": P, "followers": [pid, ...]}: P is the new sandbox's
agent (a fresh agent.py in new namespaces, see nsfork.py), followers are the pids of
the fork-aware processes (the runner) that forked themselves into it.

Egress: the sandbox has no network device but loopback. The agent listens on
127.0.0.1:$SANDBOX_EGRESS_PORT inside it (proxy variables point every process there);
each connection made to it is announced as {"stream": N} on the engine's
`egress_listen` connection, and the engine answers by opening `egress_attach` N, which
the agent splices to it. The engine's egress proxy, outside the sandbox, speaks HTTP
CONNECT / SOCKS5 with the client and enforces the rules. Nothing in the sandbox can
reach the host otherwise, nor change the rules, which live in the engine.
Managed processes (processes.py): create/get/kill/wait answer {"ok": true, <process>},
list {"ok": true, "processes": [...]}, input {"ok": true, "input_seq": N}, the others
{"ok": true}; connect answers {"ok": true} then CreateOS connect frames until `exit`.
stdin_share answers {"ok": true, "input_seq": N} with the write end of the process's stdin
attached (SCM_RIGHTS); the engine then writes input through it and sends the process's
input_seq as it goes on (a line with the number, a little after its writes), and the share
lasts until the leader exits (the agent hangs up) or the engine hangs up.
Failures are {"ok": false, "code": "not_found" | "invalid" | "conflict" | "no_space" | "failed"
| "busy" (a stdin share still held by an engine that is gone), "error": msg}; a write that
fails (a full disk) is answered at once, and the rest is read and thrown away until the
engine, which stops sending on the answer, closes: closing on unread bytes would break the
engine's next send, and asyncio then drops the unread answer.
Closing the connection before an exec finishes kills that command's process group,
as CreateOS does when a client abandons an exec.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import ctypes
import errno
import json
import os
import signal
import socket
import stat
import sys
import threading
from collections.abc import AsyncIterator, Callable

# Imported as a module of the guest package mounted in the sandbox, by run_agent.py (what
# starts an agent), so its modules are imported relatively.
from .. import protocol
from . import self_signal
from .processes import ProcessError, ProcessTable

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "run_agent.py")

CHUNK = 64 * 1024
MAX_HEADER = 1 << 20
CONNECTION_OPS = ("process_calls", "process_connect", "process_stdin_share")  # each on a connection of its own
FOLLOW_TIMEOUT = 60.0  # a fork-aware process has this long to fork itself into the new sandbox
OOM_SCORE_ADJ = b"500"  # of 1000: half the memory limit added to a process's OOM badness
ATTACH_TIMEOUT = 10.0  # an egress connection the engine does not pick up by then is closed


def frame(obj: dict) -> bytes:
    return (json.dumps(obj, ensure_ascii=True, separators=(",", ":")) + "\n").encode()


def failure(code: str, message: str) -> bytes:
    return frame({"ok": False, "code": code, "error": message})


def os_error_code(exc: OSError) -> str:
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return "not_found"
    if exc.errno in (errno.EISDIR, errno.EINVAL, errno.ENAMETOOLONG):
        return "invalid"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return "no_space"
    return "failed"


class Agent:
    def __init__(self, socket_path: str, workdir: str) -> None:
        self.socket_path = socket_path
        self.workdir = workdir
        self.egress_listener: asyncio.StreamWriter | None = None  # the engine's egress_listen
        self.pending: dict = {}  # stream number -> future of the engine's attach connection
        self.streams = 0
        self.processes = ProcessTable(workdir)  # managed processes (processes.py)
        self.signals = self_signal.SelfSignals()  # POST 127.0.0.1:1029/self/pause|delete

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handed_over = False  # an egress stream now belongs to its splice
        try:
            line = await reader.readline()
            request = json.loads(line) if line else {}
            op = request.get("op")
            if op == "ping":
                writer.write(frame({"ok": True, "pid": os.getpid()}))
            elif op == "exec":
                await self.exec(request, reader, writer)
            elif op == "write":
                await self.write_file(request, reader, writer)
            elif op == "read":
                await self.read_file(request, writer)
            elif op == "fork":
                await self.fork(request, writer)
            elif op == "egress_listen":
                await self.egress_listen(reader, writer)
            elif op == "signal_listen":
                await self.signals.engine_listens(reader, writer)
            elif op == "egress_attach":
                handed_over = self.egress_attach(request, reader, writer)
            elif op == "process_calls":
                await self.process_calls(reader, writer)
            elif isinstance(op, str) and op.startswith("process_"):
                await self.process_op(op, request, reader, writer)
            else:
                writer.write(failure("invalid", "unknown op %r" % (op,)))
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except ValueError as exc:
            writer.write(failure("invalid", "bad request: %s" % exc))
        finally:
            if not handed_over:
                writer.close()

    async def exec(self, request: dict, reader: asyncio.StreamReader,
                   writer: asyncio.StreamWriter) -> None:
        stdin = await reader.readexactly(int(request.get("stdin_size") or 0))  # first: the engine sends it
        cmd = request.get("cmd")
        args = request.get("args") or []
        if not isinstance(cmd, str) or not cmd or not all(isinstance(a, str) for a in args):
            writer.write(frame({"error": "cmd must be a non-empty string and args strings"}))
            writer.write(frame({"exit_code": -1}))
            return
        env = dict(os.environ)
        env.update(request.get("env") or {})
        try:
            proc = await asyncio.create_subprocess_exec(
                cmd, *args, stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                cwd=self.workdir, env=env, start_new_session=True, limit=CHUNK,
                preexec_fn=oom_killer_goes_here_first)
        except (OSError, ValueError) as exc:  # ValueError: a NUL or a lone surrogate in cmd, args or env
            writer.write(frame({"error": "exec %s: %s" % (cmd, getattr(exc, "strerror", None) or exc)}))
            writer.write(frame({"exit_code": -1}))
            return
        relays = [asyncio.ensure_future(self.relay(proc.stdout, "stdout", writer)),
                  asyncio.ensure_future(self.relay(proc.stderr, "stderr", writer))]
        if stdin:  # fed alongside the relays: a command may answer before it read it all
            relays.append(asyncio.ensure_future(feed_stdin(proc.stdin, stdin)))
        hangup = asyncio.ensure_future(reader.read())  # EOF here = the engine went away
        finished = asyncio.ensure_future(asyncio.gather(*relays, proc.wait()))
        await asyncio.wait([finished, hangup], return_when=asyncio.FIRST_COMPLETED)
        if not finished.done():
            kill_group(proc.pid)
            await finished
            return
        hangup.cancel()
        writer.write(frame({"exit_code": exit_status(proc.returncode)}))

    async def relay(self, pipe: asyncio.StreamReader, name: str,
                    writer: asyncio.StreamWriter) -> None:
        # Decode incrementally so a multi-byte character split across reads stays whole.
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        while True:
            chunk = await pipe.read(CHUNK)
            text = decoder.decode(chunk, final=not chunk)
            if text:
                writer.write(frame({name: text}))
                await writer.drain()
            if not chunk:
                return

    async def write_file(self, request: dict, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> None:
        path = request.get("path")
        if not isinstance(path, str) or not os.path.isabs(path):
            await refuse_upload(failure("invalid", "path must be absolute"), reader, writer)
            return
        written = 0
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            with os.fdopen(fd, "wb", buffering=0) as out:
                while True:
                    chunk = await reader.read(CHUNK)
                    if not chunk:
                        break
                    view = memoryview(chunk)
                    while view:  # unbuffered: a full disk fails here, not at close
                        view = view[out.write(view):]
                    written += len(chunk)
        except OSError as exc:
            await refuse_upload(failure(os_error_code(exc), "%s: %s" % (path, exc.strerror)), reader, writer)
            return
        size = request.get("size")
        if isinstance(size, int) and written != size:
            writer.write(failure("invalid", "%s: the upload ended after %d of %d bytes" % (path, written, size)))
            return
        writer.write(frame({"ok": True, "bytes": written}))

    async def read_file(self, request: dict, writer: asyncio.StreamWriter) -> None:
        path = request.get("path")
        if not isinstance(path, str) or not os.path.isabs(path):
            writer.write(failure("invalid", "path must be absolute"))
            return
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as exc:
            writer.write(failure(os_error_code(exc), "%s: %s" % (path, exc.strerror)))
            return
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):  # a FIFO or device would block or never end
            os.close(fd)  # (and fdopen would raise on a directory)
            what = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
            writer.write(failure("invalid", "%s: %s" % (path, what)))
            return
        with os.fdopen(fd, "rb") as src:
            writer.write(frame({"ok": True, "size": info.st_size}))
            remaining = info.st_size
            while remaining:
                chunk = src.read(min(CHUNK, remaining))
                if not chunk:  # the file shrank under us: cut the reply, the engine reports it
                    raise ConnectionError("file changed while being read")
                writer.write(chunk)
                remaining -= len(chunk)
                await writer.drain()


    async def fork(self, request: dict, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        # Loaded here, not in the forked child: the child's every millisecond is the new
        # sandbox's start, and this agent's next forks find it loaded.
        from .nsfork import become_sandbox

        listener = await receive_listener(writer)
        ready_read, ready_write = os.pipe()  # close-on-exec: EOF once the child execs
        try:
            pid = os.fork()
            if pid == 0:
                os.close(ready_read)
                self._become_fork(request, ready_write, listener, become_sandbox)  # never returns
        finally:
            os.close(ready_write)
            os.close(listener)  # the new agent has it now
        threading.Thread(target=os.waitpid, args=(pid, 0), daemon=True).start()  # reap it later
        report = await loop.run_in_executor(None, read_to_end, ready_read)
        if report:
            writer.write(failure("failed", "fork: " + report))
            return
        followers = []
        for registration in fork_aware_processes():
            reply = await ask_to_follow(registration, pid, request.get("env") or {})
            if reply.get("ok") and not followed_into(reply.get(protocol.CHILD_PID), registration, pid):
                reply = {"error": "its reply names no child of it in the new sandbox"}
            if reply.get("ok"):
                followers.append(reply[protocol.CHILD_PID])
            else:
                writer.write(failure("failed", "fork: pid %s could not follow: %s"
                                     % (registration.get(protocol.REGISTERED_PID), reply.get("error"))))
                return
        writer.write(frame({"ok": True, "pid": pid, protocol.FOLLOWERS: followers}))

    def _become_fork(self, request: dict, ready: int, listener: int,
                     become_sandbox: Callable[[str, int, str, str], None]) -> None:
        """In the forked child: set up the new sandbox, then exec a fresh agent in it that
        serves `listener`. Everything else this copy of the agent holds (its own listener,
        the engine's connections) is closed first: nsfork makes it dumpable for a moment,
        and a dumpable process's descriptors are open to the sandbox's code."""
        try:
            close_all_but(ready, listener)
            become_sandbox(str(request.get("hostname") or "sandbox"), int(request["disk_mib"]),
                           os.path.dirname(self.socket_path), self.workdir)
            os.set_inheritable(listener, True)
            os.environ.update(request.get("env") or {})
            # With this agent's optimization level (-OO where the engine chose it): the
            # bytecode bound beside the agent's modules is of that level.
            optimization = ["-" + "O" * sys.flags.optimize] if sys.flags.optimize else []
            os.execv(sys.executable, [sys.executable, "-I", "-S", *optimization, LAUNCHER,
                                      self.socket_path, self.workdir, str(listener)])
        except BaseException as exc:  # report, never fall back into the parent's event loop
            os.write(ready, ("%s: %s" % (type(exc).__name__, exc)).encode()[:4000])
        finally:
            os._exit(1)

    async def process_calls(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Managed-process ops one after another on one connection the engine keeps: its
        quick calls (a cell's input above all) skip a connection's set-up. A connect has a
        connection of its own; a bad line ends this one (handle says why)."""
        while True:
            line = await reader.readline()
            if not line:
                return
            request = json.loads(line)
            op = request.get("op") if isinstance(request, dict) else None
            if not isinstance(op, str) or not op.startswith("process_") or op in CONNECTION_OPS:
                writer.write(failure("invalid", "not an op for this connection: %r" % (op,)))
                return
            await self.process_op(op, request, reader, writer)
            await writer.drain()

    async def process_op(self, op: str, request: dict, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> None:
        """The managed-process ops (see processes.py); all but connect answer one line."""
        table = self.processes
        pid = request.get("id")
        try:
            if op == "process_create":
                reply = table.create(request, oom_killer_goes_here_first).describe()
            elif op == "process_list":
                reply = {"processes": [p.describe() for p in table.processes.values()]}
            elif op == "process_get":
                reply = table.get(pid).describe()
            elif op == "process_kill":
                reply = (await table.kill(pid, int(request.get("grace_ms") or 0))).describe()
            elif op == "process_wait":
                reply = (await table.wait(table.get(pid), request.get("scope") or "leader",
                                          request.get("timeout_ms"))).describe()
            elif op == "process_input":  # {"size": N} followed by N raw bytes
                body = body_chunks(reader, request.get("size"))
                try:
                    reply = {"input_seq": await table.write_input(pid, body)}
                finally:  # refused or cut short: take the rest, or the engine's send would fail
                    async for _ in body:
                        pass
            elif op == "process_stdin_close":
                await table.close_stdin(pid)
                reply = {}
            elif op == "process_resize":
                table.resize(pid, request.get("rows"), request.get("cols"))
                reply = {}
            elif op == "process_signal":
                table.send_signal(pid, request.get("signal"))
                reply = {}
            elif op == "process_connect":
                await self.process_connect(table.get(pid), int(request.get("after") or 0),
                                           reader, writer)
                return
            elif op == "process_stdin_share":
                await self.share_stdin(table.get(pid), reader, writer)
                return
            else:
                raise ProcessError("invalid", "unknown op %r" % (op,))
        except ProcessError as exc:
            writer.write(failure(exc.code, str(exc)))
            return
        writer.write(frame({"ok": True, **reply}))

    async def process_connect(self, process, after: int, reader: asyncio.StreamReader,
                              writer: asyncio.StreamWriter) -> None:
        """{"ok": true} then the process's frames until exit, or until the engine hangs up."""
        async def send(line: bytes) -> None:
            writer.write(line)
            await writer.drain()

        await send(frame({"ok": True}))
        streaming = asyncio.ensure_future(self.processes.stream(process, after, send))
        hangup = asyncio.ensure_future(reader.read())  # EOF here = the engine went away
        await asyncio.wait([streaming, hangup], return_when=asyncio.FIRST_COMPLETED)
        for task in (streaming, hangup):
            task.cancel()

    async def share_stdin(self, process, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Give the engine the write end of `process`'s stdin, then take the input_seq it
        reports, until the engine hangs up or the leader exits (processes.end_stdin_share
        hangs up). Input written by the agent meanwhile is still serialized with its own;
        the engine sends none while it holds the share."""
        async with process.input_lock:  # no write of ours is half done as it is handed over
            fd = self.processes.shareable_stdin(process)
            answer = frame({"ok": True, "input_seq": process.input_seq})
            with socket.socket(fileno=os.dup(writer.get_extra_info("socket").fileno())) as raw:
                socket.send_fds(raw, [answer], [fd])  # nothing is buffered on this connection yet
            process.stdin_share = writer
        try:
            await take_shared_input_seq(process, reader)
        finally:
            if process.stdin_share is writer:
                process.stdin_share = None

    async def egress_listen(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Hold the engine's announcement channel open until the engine goes away."""
        self.egress_listener = writer
        writer.write(frame({"ok": True}))
        await writer.drain()
        await reader.read()
        if self.egress_listener is writer:
            self.egress_listener = None

    async def egress_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A process in the sandbox connected to the egress port: have the engine take it."""
        listener = self.egress_listener
        if listener is None:  # no engine listening: no network at all
            writer.close()
            return
        self.streams += 1
        number = self.streams
        attached: asyncio.Future = asyncio.get_running_loop().create_future()
        self.pending[number] = attached
        try:
            listener.write(frame({"stream": number}))
            await listener.drain()
            engine_reader, engine_writer = await asyncio.wait_for(attached, ATTACH_TIMEOUT)
        except (ConnectionError, asyncio.TimeoutError):
            writer.close()
            return
        finally:
            self.pending.pop(number, None)
        await splice(reader, writer, engine_reader, engine_writer)

    def egress_attach(self, request: dict, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> bool:
        """Give the engine's connection to the waiting client; False if none waits for it."""
        attached = self.pending.get(request.get("stream"))
        if attached is None or attached.done():
            return False
        attached.set_result((reader, writer))
        return True


async def take_shared_input_seq(process, reader: asyncio.StreamReader) -> None:
    """The process's input_seq as the engine writing its stdin reports it (a number per
    line), until it hangs up or sends what is not a number."""
    while True:
        number = (await reader.readline()).strip()
        if not number.isdigit() or len(number) > 18:
            return
        process.input_seq = max(process.input_seq, int(number))


async def refuse_upload(answer: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer a failed upload now, then discard what is still coming until the engine closes."""
    writer.write(answer)
    await writer.drain()
    while await reader.read(CHUNK):
        pass


async def splice(reader_a: asyncio.StreamReader, writer_a: asyncio.StreamWriter,
                 reader_b: asyncio.StreamReader, writer_b: asyncio.StreamWriter) -> None:
    """Copy bytes both ways until both directions are done; then close both."""
    async def pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while True:
                chunk = await source.read(CHUNK)
                if not chunk:
                    if sink.can_write_eof():
                        sink.write_eof()
                    return
                sink.write(chunk)
                await sink.drain()
        except (ConnectionError, OSError):
            return

    await asyncio.gather(pump(reader_a, writer_b), pump(reader_b, writer_a))
    for writer in (writer_a, writer_b):
        writer.close()


async def body_chunks(reader: asyncio.StreamReader, size) -> AsyncIterator[bytes]:
    """The `size` raw bytes that follow a request line, a chunk at a time."""
    remaining = int(size or 0)
    while remaining:
        chunk = await reader.read(min(CHUNK, remaining))
        if not chunk:
            raise ConnectionError("request body ended early")
        remaining -= len(chunk)
        yield chunk


async def feed_stdin(pipe: asyncio.StreamWriter, data: bytes) -> None:
    """An exec's `stdin`: write it all, then close (EOF); a command that stops reading early is fine."""
    try:
        pipe.write(data)
        await pipe.drain()
        pipe.close()
    except (BrokenPipeError, ConnectionResetError):
        pass


async def receive_listener(writer: asyncio.StreamWriter) -> int:
    """The listening socket the engine sends for a fork's agent, as ancillary data on a
    byte after the request. asyncio must not read that byte (its plain read would drop the
    descriptor): reading stops before the engine is told to send it."""
    writer.transport.pause_reading()
    writer.write(frame({"ok": True}))
    await writer.drain()
    fd = os.dup(writer.get_extra_info("socket").fileno())
    with socket.socket(fileno=fd) as connection:
        connection.settimeout(ATTACH_TIMEOUT)
        _, fds, _, _ = await asyncio.to_thread(socket.recv_fds, connection, 1, 1)
    if len(fds) != 1:
        for extra in fds:
            os.close(extra)
        raise ValueError("the fork request came without its listening socket")
    return fds[0]


def close_all_but(*kept: int) -> None:
    """Close every descriptor above stderr except `kept`."""
    low = 3
    for fd in sorted(kept):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, os.sysconf("SC_OPEN_MAX"))


def close_sockets() -> None:
    """Close the sockets above stderr of this process (a child of the agent, before exec):
    the agent's listener and its connections to the engine, which a command must never
    hold. CPython's own pipe that reports a failed exec stays open."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        with contextlib.suppress(OSError):  # (the listing's own descriptor is gone by now)
            if fd > 2 and stat.S_ISSOCK(os.fstat(fd).st_mode):
                os.close(fd)


def read_to_end(fd: int) -> str:
    with os.fdopen(fd, "rb") as pipe:
        return pipe.read().decode(errors="replace").strip()


def fork_aware_processes() -> list:
    """Processes that registered to follow a fork (the runner does, see runner/daemon.py)."""
    directory = os.environ.get(protocol.FORKABLE_DIR_ENV)
    found = []
    for name in sorted(os.listdir(directory)) if directory and os.path.isdir(directory) else []:
        try:
            with open(os.path.join(directory, name)) as entry:
                registration = json.load(entry)
            os.kill(int(registration[protocol.REGISTERED_PID]), 0)
        except (OSError, ValueError, KeyError, TypeError):
            continue  # stale or garbage: its process is gone
        found.append(registration)
    return found


def followed_into(child_pid: object, registration: dict, sandbox_pid: int) -> bool:
    """Did the registered process really fork `child_pid` into the new sandbox? A
    registration is written by code in the sandbox, and the engine puts the pids the
    agent reports into the new sandbox's cgroups: a forged one must not name the agent or
    any other process of this sandbox."""
    try:
        with open("/proc/%d/status" % int(child_pid)) as status:
            parent = next(int(line.split()[1]) for line in status if line.startswith("PPid:"))
        same_root = (os.readlink("/proc/%d/ns/mnt" % int(child_pid))
                     == os.readlink("/proc/%d/ns/mnt" % sandbox_pid))
    except (OSError, ValueError, TypeError, StopIteration):
        return False
    return same_root and parent == int(registration[protocol.REGISTERED_PID]) and int(child_pid) != sandbox_pid


async def ask_to_follow(registration: dict, join_pid: int, env: dict) -> dict:
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_unix_connection(str(registration[protocol.REGISTERED_SOCKET])), 5)
        writer.write(frame({protocol.OP: protocol.FORK, protocol.JOIN_PID: join_pid, protocol.FORK_ENV: env}))
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), FOLLOW_TIMEOUT)
        writer.close()
        return json.loads(line) if line else {"ok": False, "error": "no answer"}
    except (OSError, ValueError, asyncio.TimeoutError) as exc:
        return {"ok": False, "error": str(exc) or type(exc).__name__}


def oom_killer_goes_here_first() -> None:
    """In a command's process, before exec: at the sandbox's memory limit the OOM killer
    must take the user's processes (this one and all it starts inherit the value), never
    the agent, which stays at 0 and whose death would end the sandbox. Raising one's own
    oom_score_adj needs no privilege (lowering it below 0 would). The fork of the agent
    is undumpable like it, so its /proc files are root's until it is dumpable again; and
    once dumpable, code in the sandbox may copy its descriptors (pidfd_getfd) or write its
    memory until it execs: the agent's sockets are closed before."""
    close_sockets()
    set_dumpable(True)
    fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
    try:
        os.write(fd, OOM_SCORE_ADJ)
    finally:
        os.close(fd)


def exit_status(returncode: int) -> int:
    """Shell convention: a command killed by signal N exits 128+N."""
    return 128 - returncode if returncode < 0 else returncode


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


async def serve(socket_path: str, workdir: str, listen_fd: int) -> None:
    """Serve on the socket the engine bound for us (listen_fd), in a host directory no
    sandbox reaches. socket_path names the empty, read-only directory inside."""
    agent = Agent(socket_path, workdir)
    forkable = os.environ.get(protocol.FORKABLE_DIR_ENV)
    if forkable:
        os.makedirs(forkable, mode=0o700, exist_ok=True)
    egress_port = os.environ.get("SANDBOX_EGRESS_PORT")
    if egress_port:
        await asyncio.start_server(agent.egress_client, "127.0.0.1", int(egress_port))
    await self_signal.serve(agent.signals)
    listener = socket.socket(fileno=listen_fd)
    listener.set_inheritable(False)  # no command it starts may hold it
    server = await asyncio.start_unix_server(agent.handle, sock=listener, limit=MAX_HEADER)
    stop = asyncio.get_running_loop().create_future()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set_result, None)
    async with server:
        await stop


def apply_rlimits() -> None:
    """Set the limits the engine could not enforce with cgroups (SANDBOX_RLIMITS, e.g.
    "data=536870912,nproc=512"), soft and hard, on this process and so on everything it
    starts; without privilege nothing in the sandbox can raise them again."""
    import resource

    spec = os.environ.pop("SANDBOX_RLIMITS", "")
    names = {"data": resource.RLIMIT_DATA, "nproc": resource.RLIMIT_NPROC}
    for item in filter(None, spec.split(",")):
        name, _, value = item.partition("=")
        resource.setrlimit(names[name], (int(value), int(value)))


def set_dumpable(dumpable: bool) -> None:
    """The agent runs as the sandbox's user, like the code it starts: undumpable, its
    /proc/PID/mem, environ, root and fds are closed to processes without CAP_SYS_PTRACE
    over it, which no process of the sandbox has (the dumpable flag is reset on exec, so
    the commands the agent starts are not affected)."""
    PR_SET_DUMPABLE = 4
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, int(dumpable), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE)")


def main(argv: list) -> int:
    if len(argv) != 4:
        sys.stderr.write("usage: run_agent.py SOCKET WORKDIR LISTEN_FD\n")
        return 2
    apply_rlimits()
    os.umask(0o022)  # the engine's is 077; files made in the sandbox get the usual modes
    asyncio.run(serve(argv[1], argv[2], int(argv[3])))
    return 0
