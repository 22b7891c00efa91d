"""The runner daemon: holds the user's session, serves its clients, runs their cells.

``serve DIR`` (started through __main__.py) listens on ``DIR/runner.sock``, writes
``DIR/ready`` (its info: pid, Python, the bundle's hash) as soon as it can take requests,
then starts its engine. Each connection is a one-shot request (``run``: the cell's events as
NDJSON, to its ``done``; any other op: one reply) or a relay's channel (channel.py). One-shot
ops are answered by the handler of the op in Daemon's table (Daemon.answer). Besides the
code, a ``run`` carries what the execute_request asked (see protocol.RUN): ``allow_stdin``,
``user_expressions`` (evaluated after the cell and returned in its ``done`` event with its
``payload``), ``parent_msg_id``, a ``subshell_id``, or a ``comm`` message to deliver
instead of code, on the event loop (so while a cell awaits). The ``fork`` op (fork.py)
forks the daemon with the user's live state into another sandbox; the daemon offers it
fork_locks, leave_parent and take_over.
"""
from __future__ import annotations

import json
import os
import platform
import re
import signal
import socket
import sys
import threading
import time
import traceback
import typing

from .. import bundle, protocol
from . import debug, fork
from .bridges import CommBridge, InputBridge, checked_comm_message
from .cells import Cell, OutputBudget
from .channel import Channel
from .environment import importable, use_workspace_packages
from .output import FdCapture, OutputRouter, ParentRequests, make_cell_stream
from .usage import UsageMeter
from .wire import encode_line, write_json_atomically

if typing.TYPE_CHECKING:
    import concurrent.futures

SOCKET_NAME = "runner.sock"
READY_NAME = "ready"
NO_IPYTHON_ENV = "SANDBOX_KERNEL_RUNNER_NO_IPYTHON"
LOG_NAME = "runner.log"  # where the kernel points the daemon's stdout/stderr (a forked child reopens it)
MAX_CELLS = 200  # beyond this many cells the oldest finished ones are forgotten
USAGE = "usage: runner serve DIR   (clients: client.py)\n"

# Imported by _import_after_ready: asyncio, the largest of the daemon's imports (50 to 90 ms
# on a busy 2-core machine), comes after the ready file, so the kernel's last steps overlap
# it; the loops (loop.py) and the engines (plain.py, ipython.py) import it.
asyncio: typing.Any = None
loop: typing.Any = None
plain: typing.Any = None
ipython: typing.Any = None


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "serve":
        Daemon(os.path.abspath(argv[1])).serve_forever()
        return 0
    sys.stderr.write(USAGE)
    return 2


def _import_after_ready() -> None:
    global asyncio, loop, plain, ipython
    import asyncio

    from . import ipython, loop, plain


def _look_in_working_directory_first() -> None:
    """Imports look in the working directory first, as in any kernel: '' where Python put
    the bundle's root (which holds nothing for user code; see __main__.py). Only once the
    daemon's own imports are done: no file of the user's may stand in for one of them."""
    bundle_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if sys.path and sys.path[0] == bundle_root:
        sys.path[0] = ""


class Daemon:
    """Holds the user's session: accepts clients on the unix socket in
    background threads and runs queued cells one by one in the main thread
    (required for signal-based KeyboardInterrupt), on an asyncio event loop that
    runs in and between cells, as under ipykernel; a kernel subshell's cells in its
    own thread (loop.Subshell), which an interrupt does not reach, as under ipykernel."""

    def __init__(self, state_dir: str):
        self.set_state_dir(state_dir)
        self._cells: dict[str, Cell] = {}  # in submission order
        self._queue: loop.CellQueue  # the main shell's (made with the loop, serve_forever)
        self._subshells: dict[str, loop.Subshell] = {}
        self._lock = threading.Lock()
        self._running: Cell | None = None
        self._main_thread = threading.get_ident()
        self._loop: asyncio.AbstractEventLoop  # the main thread's (_main_loop)
        self._server: socket.socket | None = None
        self._connections: set = set()  # open client connections (a forked child closes its copies)
        self._channels: set = set()  # the relays' channels (a forked child closes their pipes)
        self.registration_path: str | None = None
        self._usage = UsageMeter()
        # Set once the engine, its bridges and the debugger exist: the ready file comes
        # before (serve_forever), and requests wait for this (_serve_connection).
        self._built = threading.Event()
        self._use_ipython = os.environ.get(NO_IPYTHON_ENV) != "1" and importable("IPython")
        # Hashed at start, before any other kernel can upload a newer bundle over these files:
        # the kernel tells from it whether this runner is of its own version.
        self.bundle = bundle.own_hash()
        self._handlers: dict[str, typing.Callable[[dict], dict]] = {
            protocol.INTERRUPT: self._interrupt, protocol.INPUT: self._answer_input,
            protocol.COMPLETE: self._complete, protocol.INSPECT: self._inspect, protocol.INFO: self._info_reply,
            protocol.SHUTDOWN: lambda request: {"ok": True},  # its connection ends the daemon after the reply
            protocol.USAGE: lambda request: self._usage.sample(), protocol.COMM_INFO: self._comm_info,
            protocol.DEBUG: self._debug, protocol.SUBSHELL: self._subshell_request,
            protocol.FORK: lambda request: fork.fork(self, request)}

    def set_state_dir(self, state_dir: str) -> None:
        self.state_dir = state_dir
        self.socket_path = os.path.join(state_dir, SOCKET_NAME)
        self.ready_path = os.path.join(state_dir, READY_NAME)

    def serve_forever(self) -> None:
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        os.chmod(self.state_dir, 0o700)
        self.parents = ParentRequests()
        self.router = OutputRouter(FdCapture(), self.parents)
        self.router.start_threads()
        threading.excepthook = self._log_thread_exception
        use_workspace_packages()
        sys.stdout = make_cell_stream(self.router, "stdout", 1)
        sys.stderr = make_cell_stream(self.router, "stderr", 2)
        # SIGINT is ignored between cells and a KeyboardInterrupt during them.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, lambda signum, frame: self.exit())
        # Ready before IPython starts, the longest part of this start: the kernel's own
        # last steps (its channel to us, the frontend's kernel_info) overlap it, and its
        # requests wait for it here.
        self._start_serving()
        _import_after_ready()
        _look_in_working_directory_first()
        self.engine = self._create_engine()
        self.inputs = InputBridge(self.router)
        self.inputs.install()
        self.comms = CommBridge(self.router, self.parents)
        # Made before requests are served: one may schedule work on it (submit) before it runs.
        self._loop = asyncio.new_event_loop()
        self._queue = loop.CellQueue()
        self.debugger = self._create_debugger()
        self._built.set()
        self._main_loop()

    def _start_serving(self) -> None:
        self._server = self._listen()
        threading.Thread(target=self._accept_forever, args=(self._server,), name="accept", daemon=True).start()
        # Registered before it says it is ready: a sandbox forked as soon as its runner is
        # ready must take the runner along (a fork asked for meanwhile waits for _built too).
        self._register()
        self._write_ready()

    def _main_loop(self) -> None:
        """Run queued cells forever on a new event loop. A cell can use the running loop
        and await at top level; tasks it starts run on while it awaits and between cells."""
        self._loop_files = loop.event_loop_files()
        asyncio.set_event_loop(self._loop)
        cells = self._loop.create_task(self._queue.serve(self._execute))
        while True:
            try:
                self._loop.run_until_complete(cells)
            except KeyboardInterrupt:
                # Landed in a task of the user's while an async cell awaited: that task
                # ends with it; the loop and the cell go on.
                if cells.done():
                    cells = self._loop.create_task(self._queue.serve(self._execute))

    def _create_engine(self):
        inline = self._use_ipython and importable("matplotlib_inline")
        # Must be set before user code imports matplotlib.
        os.environ["MPLBACKEND"] = "module://matplotlib_inline.backend_inline" if inline else "Agg"
        if self._use_ipython:
            try:
                return ipython.IPythonEngine(self.router, self.parents)
            except Exception:
                self.router.log("IPython failed to start, using the plain engine:\n" + traceback.format_exc())
                os.environ["MPLBACKEND"] = "Agg"
        return plain.PlainEngine(self.router)

    def _create_debugger(self) -> debug.Debugger | None:
        """The debugger (debug.py), where debugpy is importable and cells run in IPython."""
        if not isinstance(self.engine, ipython.IPythonEngine) or not debug.debugpy_importable():
            return None
        # The guest package's files (the runner's and the protocol's) are never debugged.
        package_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        try:
            # DAP events go out as between-cell events ("cell": null) to the channels. (The
            # between-cell log is made on first use: until a channel asks, such output goes to the log.)
            return debug.Debugger(self._on_main_thread,
                                  lambda message: self.router.background().emit(protocol.DEBUG_EVENT, content=message),
                                  self.engine.shell, [package_dir], os.path.join(self.state_dir, "debugpy.log"))
        except Exception:
            self.router.log("the debugger is not available:\n" + traceback.format_exc())
            return None

    def _info(self) -> dict:
        """The info op's answer; the ready file's, written while IPython starts, has no
        ipython_version and tells what the engine will have: the debugger, and subshells
        (threads that run cells with IPython's run_cell, as ipykernel's do). An IPython
        that then fails to start, leaving the plain engine, is the one case where it is wrong."""
        info = {"pid": os.getpid(), "python_version": platform.python_version(),
                "implementation": platform.python_implementation(), bundle.INFO_FIELD: self.bundle}
        if not self._built.is_set():
            return dict(info, debugger=self._use_ipython and debug.debugpy_importable(),
                        subshells=self._use_ipython)
        return dict(info, ipython_version=self.engine.ipython_version, debugger=self.debugger is not None,
                    subshells=isinstance(self.engine, ipython.IPythonEngine))

    def _listen(self) -> socket.socket:
        if os.path.exists(self.socket_path):
            if _socket_alive(self.socket_path):
                raise SystemExit("another daemon is serving %s" % self.socket_path)
            os.remove(self.socket_path)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # the socket is created 0600, with no window
        try:
            server.bind(self.socket_path)
        finally:
            os.umask(old_umask)
        server.listen(64)
        return server

    def _write_ready(self) -> None:
        write_json_atomically(self.ready_path, self._info())

    def _register(self) -> None:
        """Tell the local engine's agent that this process can fork along with its sandbox."""
        directory = os.environ.get(protocol.FORKABLE_DIR_ENV)
        if not directory:
            return
        path = os.path.join(directory, "%d.json" % os.getpid())
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
            write_json_atomically(path, {protocol.REGISTERED_PID: os.getpid(), protocol.REGISTERED_SOCKET: self.socket_path})
        except OSError as exc:
            self.router.log("could not register in %s=%s: %s\n" % (protocol.FORKABLE_DIR_ENV, directory, exc))
            return
        self.registration_path = path

    def exit(self) -> None:
        """End the daemon at once, its files removed."""
        for path in (self.ready_path, self.socket_path, self.registration_path):
            if path is None:
                continue
            try:
                os.remove(path)
            except OSError:
                pass
        os._exit(0)

    def _log_thread_exception(self, args) -> None:
        text = "".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback))
        self.router.log("exception in thread %s:\n%s" % (args.thread and args.thread.name, text))

    # --- execution (the main thread, or a subshell's)

    async def _execute(self, cell: Cell) -> None:
        stored = cell.store_history and not cell.silent
        if stored and cell.execution_count is not None:
            self.engine.execution_count = count = cell.execution_count  # the kernel's number for it
        else:
            count = self.engine.execution_count if stored else self.engine.execution_count - 1
        cell.started_count, cell.stored = count, stored
        self.router.begin(cell)
        in_main = cell.subshell_id is None
        # A subshell's cell sets its own thread's parent, not the between-cells one.
        parent = self.parents.enter(cell.parent_msg_id, between_cells=in_main)
        ok = False
        reply: dict = {}  # for the execute_reply: user_expressions, payload
        try:
            if in_main:
                ok = await self._run_user_code(cell, stored, count)
            else:  # no interrupt, no debugger: as in ipykernel's subshell threads
                ok = await self.engine.run(cell.code, cell.silent, stored, count)
            if ok and cell.user_expressions:
                reply["user_expressions"] = self.engine.user_expressions(cell.user_expressions)
            payload = self.engine.take_payload()
            if payload:
                reply["payload"] = payload
        except Exception:
            self.router.log("internal error running %s:\n%s" % (cell.cell_id, traceback.format_exc()))
        finally:
            self.parents.leave(parent)
            self.router.end(cell)
            cell.emit(protocol.DONE, status="ok" if ok else "error", execution_count=count, **reply)
            cell.code = ""  # its events have what matters now

    async def _run_user_code(self, cell: Cell, stored: bool, count: int) -> bool:
        self._start_running(cell)
        try:
            if self.debugger is not None:
                self.debugger.before_cell()
            return await self.engine.run(cell.code, cell.silent, stored, count)
        except KeyboardInterrupt:  # landed in engine code rather than in the user's
            self.router.emit(protocol.ERROR_EVENT, ename="KeyboardInterrupt", evalue="", traceback=[])
            return False
        finally:
            self._stop_running()

    def _start_running(self, cell: Cell) -> None:
        """User code runs for cell from now on: an interrupt raises KeyboardInterrupt in it."""
        with self._lock:
            self._running = cell
        signal.signal(signal.SIGINT, self._on_interrupt)

    def _stop_running(self) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with self._lock:
            self._running = None

    def _deliver_comm(self, cell: Cell) -> None:
        """A frontend's comm message, handed to the comm manager on the main thread's loop
        (Daemon.submit schedules it there): at once between cells, and while a cell awaits
        (a cell may wait for a widget's answer, as under ipykernel); after a cell that never
        awaits, in the order they came. Its handlers' output answers its request: during a
        cell it goes out among that cell's events, naming its parent (see ParentRequests)."""
        during_cell = self.router.current_cell is not None
        if not during_cell:
            self.router.begin(cell)
            self._start_running(cell)
        parent = self.parents.enter(cell.parent_msg_id, between_cells=False)
        try:
            self.comms.deliver(cell.comm)  # its handlers log their own errors
        except KeyboardInterrupt:
            if during_cell and loop.CellTask.current is not None:
                loop.CellTask.current.cancel()  # the interrupt was meant for the awaiting cell
        except Exception:
            self.router.log("internal error delivering %s:\n%s" % (cell.cell_id, traceback.format_exc()))
        finally:
            self.parents.leave(parent)
            if not during_cell:
                self._stop_running()
                self.router.end(cell)
            cell.emit(protocol.DONE, status="ok")
            cell.code = ""

    def _on_interrupt(self, signum: int, frame) -> None:
        """SIGINT during a cell: a KeyboardInterrupt where the cell's code runs; but a cell
        awaiting (the loop idle in its selector) is cancelled instead, as under ipykernel,
        since the exception would end the loop rather than the cell."""
        task = loop.CellTask.current
        if task is not None and frame is not None and frame.f_code.co_filename.startswith(self._loop_files):
            self._loop.call_soon_threadsafe(task.cancel)
            return
        raise KeyboardInterrupt

    # --- connections (background threads)

    def _accept_forever(self, server: socket.socket) -> None:
        while True:
            connection, _ = server.accept()
            self._connections.add(connection)
            threading.Thread(target=self._serve_connection, args=(connection,), daemon=True).start()

    def _serve_connection(self, connection: socket.socket) -> None:
        try:
            if not self._built.is_set():  # (never waits once set: no lock a fork could copy held)
                self._built.wait()
            self._serve_request(connection)
        finally:
            self._connections.discard(connection)

    def _serve_request(self, connection: socket.socket) -> None:
        with connection:
            fds: list = []
            try:
                line, fds = _receive_request(connection)
                request = json.loads(line)
                if not isinstance(request, dict):
                    raise ValueError("the request must be a JSON object")
                op = request.get(protocol.OP)
                if op == protocol.CHANNEL:
                    if len(fds) != 2:
                        raise ValueError("a channel comes with the relay's stdin and stdout")
                    pipes, fds = fds, []  # the channel's to close from here on
                    self._serve_channel(connection, request, pipes)
                    return
                if op == protocol.RUN:
                    self._stream(connection, request)
                    return
                connection.sendall(encode_line(self.answer(request)))
                if op == protocol.SHUTDOWN:
                    connection.close()
                    self.exit()
            except OSError:
                pass  # the client went away; its next run with `after` resumes
            except Exception as exc:  # a bad request: tell the client why
                try:
                    connection.sendall(encode_line({protocol.ERROR: "%s: %s" % (type(exc).__name__, exc)}))
                except OSError:
                    pass
            finally:
                for fd in fds:  # passed with a request that takes none
                    os.close(fd)

    def _serve_channel(self, connection: socket.socket, request: dict, pipes: list) -> None:
        """A relay's channel, on the relay's stdin and stdout (passed with the request)."""
        channel = Channel(self, connection, *pipes)
        self._channels.add(channel)
        try:
            channel.serve(request)
        finally:
            self._channels.discard(channel)

    def _stream(self, connection: socket.socket, request: dict) -> None:
        """Send a cell's events with seq > after, until done or ``wait`` seconds."""
        after = int(request.get("after") or 0)
        # "wait": return after that many seconds even if the cell is not done (polling
        # clients, when the sandbox service cannot stream an exec's output).
        wait = request.get("wait")
        cell = self.submit(request)
        deadline = None if wait is None else time.monotonic() + float(wait)
        while True:
            lines, finished = cell.read_after(after, deadline)
            if lines:
                connection.sendall(b"".join(lines))
                after += len(lines)
            if finished or (deadline is not None and time.monotonic() >= deadline):
                return

    def submit(self, request: dict) -> Cell:
        """Queue a cell, unless that cell_id is known already (then just return it)."""
        cell_id = _checked_cell_id(request.get("cell_id"))
        with self._lock:
            cell = self._cells.get(cell_id)
            if cell is None:
                comm_message = checked_comm_message(request.get("comm"))  # checked before anything is made
                code = request["code"] if "code" in request else _take_code_file(request["code_file"])
                count = request.get("execution_count")
                cell = Cell(cell_id, code, bool(request.get("silent")), bool(request.get("store_history", True)),
                            count if isinstance(count, int) else None, OutputBudget.from_request(request))
                cell.allow_stdin = bool(request.get("allow_stdin", True))
                cell.comm = comm_message
                subshell = self._subshell_of(request) if comm_message is None else None
                cell.subshell_id = subshell.subshell_id if subshell is not None else None
                parent_msg_id = request.get("parent_msg_id")
                cell.parent_msg_id = parent_msg_id if isinstance(parent_msg_id, str) else None
                expressions = request.get("user_expressions")
                if isinstance(expressions, dict):
                    cell.user_expressions = {str(k): str(v) for k, v in expressions.items()}
                self._cells[cell_id] = cell
                self._forget_old_cells()
                if comm_message is not None:
                    self._loop.call_soon_threadsafe(self._deliver_comm, cell)
                else:
                    (subshell.cells if subshell is not None else self._queue).put(cell)
        return cell

    def _subshell_of(self, request: dict) -> loop.Subshell | None:
        """The subshell a run names (None: the main shell); the caller holds self._lock. One
        this runner does not know was made before it started (the last one died, or this is
        a fork): its thread starts now. (The kernel sends only ids of subshells it has.)"""
        subshell_id = request.get(protocol.SUBSHELL_ID)
        if subshell_id is None:
            return None
        return self._subshells.get(subshell_id) or self._start_subshell(subshell_id)

    def _start_subshell(self, subshell_id: object) -> loop.Subshell:
        """The caller holds self._lock."""
        if not isinstance(subshell_id, str) or not subshell_id:
            raise ValueError("a subshell_id must be a non-empty string")
        if not isinstance(self.engine, ipython.IPythonEngine):
            raise ValueError("subshells need IPython in the sandbox")
        subshell = self._subshells[subshell_id] = loop.Subshell(subshell_id, self._execute)
        return subshell

    def _subshell_request(self, request: dict) -> dict:
        """Create or delete a subshell (the kernel's subshell manager names it); deleting
        waits for its queued cells, as ipykernel's delete joins the subshell's thread."""
        action, subshell_id = request.get("action"), request.get(protocol.SUBSHELL_ID)
        if action == "create":
            with self._lock:
                if subshell_id not in self._subshells:
                    self._start_subshell(subshell_id)
            return {"ok": True}
        if action == "delete":
            with self._lock:
                subshell = self._subshells.pop(subshell_id, None)
            if subshell is not None:
                subshell.end()
            return {"ok": subshell is not None}
        raise ValueError("unknown subshell action %r" % (action,))

    def _forget_old_cells(self) -> None:
        excess = len(self._cells) - MAX_CELLS
        for old in [cell for cell in self._cells.values() if cell.finished][:max(excess, 0)]:
            del self._cells[old.cell_id]

    # --- one-shot requests: the handlers of Daemon._handlers

    def answer(self, request: dict) -> dict:
        """The reply to a one-shot request, from the handler of its op."""
        op = request.get(protocol.OP)
        handler = self._handlers.get(op) if isinstance(op, str) else None
        if handler is None:
            raise ValueError("unknown op %r" % (op,))
        return handler(request)

    def _interrupt(self, request: dict) -> dict:
        if self.debugger is not None:
            self.debugger.interrupting()
        with self._lock:
            running = self._running
            if running is not None:
                # Delivered to the main thread so blocking calls (sleep, input) wake up too.
                signal.pthread_kill(self._main_thread, signal.SIGINT)
        return {"ok": True, "running": running.cell_id if running is not None else None}

    def _answer_input(self, request: dict) -> dict:
        value = None if request.get("eof") else str(request.get("value", ""))
        return {"ok": self.inputs.answer(str(request.get(protocol.CELL_ID)), value)}

    def _complete(self, request: dict) -> dict:
        return self.engine.complete(request["code"], int(request["cursor_pos"]))

    def _inspect(self, request: dict) -> dict:
        return self.engine.inspect(request["code"], int(request["cursor_pos"]), int(request.get("detail_level") or 0))

    def _info_reply(self, request: dict) -> dict:
        return dict(self._info(), execution_count=self.engine.execution_count)

    def _comm_info(self, request: dict) -> dict:
        return {"comms": self.comms.info(request.get("target_name"))}

    def _debug(self, request: dict) -> dict:
        if self.debugger is None:
            raise ValueError("no debugger in this sandbox (it needs IPython and debugpy)")
        return {"response": self.debugger.handle(request.get("request"))}

    # --- fork (fork.py drives it; these are what it asks of the daemon)

    def fork_locks(self) -> list:
        """The locks held around os.fork(), in the order the other threads take them:
        the daemon's, the router's, then the unfinished cells'."""
        locks = [(self._lock.acquire, self._lock.release), (self.router.hold, self.router.release)]
        return locks + [(cell.hold, cell.release) for cell in self._cells.values() if not cell.finished]

    def leave_parent(self) -> None:
        """Fork child: this thread is the main thread now; the parent's sockets are not ours."""
        self._main_thread = threading.get_ident()
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # between cells
        for connection in list(self._connections):  # the parent's clients (and the fork request)
            _close_socket(connection)
        self._connections = set()
        for channel in list(self._channels):
            channel.abandon()
        self._channels = set()
        if self._server is not None:
            _close_socket(self._server)
            self._server = None

    def take_over(self) -> None:
        """Fork child, in the new sandbox: re-create everything tied to the parent's
        threads, locks and fds, then serve (ready file and registration last)."""
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        os.chmod(self.state_dir, 0o700)

        # Output: fds 1 and 2 still point into the parent's pipes, the log fds at its log.
        log_fd = os.open(os.path.join(self.state_dir, LOG_NAME), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.router.capture.close_after_fork()
        self.router.reset_after_fork(FdCapture({"stdout": log_fd, "stderr": os.dup(log_fd)}))

        # Cells: the running and queued ones stay with the parent; end them here.
        running = self.router.current_cell
        unfinished = []
        for cell in self._cells.values():
            cell.reset_after_fork()
            if not cell.finished:
                unfinished.append(cell)
        if running is not None:
            self.router.end(running)  # its pending output goes in first
        for cell in unfinished:
            cell.abort_after_fork()
            if cell.stored and cell.started_count is not None:  # its number was handed out
                self.engine.execution_count = max(self.engine.execution_count, cell.started_count + 1)
        self._queue = loop.CellQueue()
        self._subshells = {}  # their threads stayed in the parent (their cells were ended above)
        self._loop = asyncio.new_event_loop()  # the parent's loop holds the parent's tasks
        self._lock = threading.Lock()
        self._running = None
        self.inputs.reset_after_fork()
        self.engine.reset_after_fork()

        self.router.start_threads()
        self._start_serving()

    def _on_main_thread(self, work) -> concurrent.futures.Future:
        """Run work on the main thread, on its event loop (so between cells); its future."""
        import concurrent.futures  # imported by asyncio already

        result: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                result.set_result(work())
            except BaseException as exc:
                result.set_exception(exc)

        self._loop.call_soon_threadsafe(run)
        return result

    def serve_cells(self) -> None:
        self._main_loop()

    def log(self, text: str) -> None:
        self.router.log(text)


def _close_socket(sock: socket.socket) -> None:
    """Close our fd of a socket whatever its state (a makefile may still refer to it)."""
    try:
        fd = sock.detach()
        if fd >= 0:
            os.close(fd)
    except OSError:
        pass


# A request's first read: room for the two descriptors a relay passes with its channel request.
_FDS_SPACE = socket.CMSG_SPACE(2 * 4)
_REQUEST_LIMIT = 1 << 20  # a request line longer than this is refused (large code comes as a file)


def _receive_request(connection: socket.socket) -> "tuple[bytes, list]":
    """A client's request line, and the descriptors that came with it (close-on-exec: a
    cell's subprocesses must not inherit a channel's pipes)."""
    data, ancillary, _, _ = connection.recvmsg(1 << 16, _FDS_SPACE, socket.MSG_CMSG_CLOEXEC)
    fds: list = []
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(payload) - len(payload) % 4
            fds.extend(int.from_bytes(payload[at:at + 4], sys.byteorder) for at in range(0, usable, 4))
    try:
        while b"\n" not in data:
            if len(data) > _REQUEST_LIMIT:
                raise ValueError("request line too long")
            more = connection.recv(1 << 16)
            if not more:
                break
            data += more
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return data.split(b"\n", 1)[0], fds


def _checked_cell_id(cell_id: object) -> str:
    if not isinstance(cell_id, str) or not re.fullmatch(r"[A-Za-z0-9._-]{1,128}", cell_id):
        raise ValueError("invalid cell_id %r" % (cell_id,))
    return cell_id


def _take_code_file(path: str) -> str:
    """Code of a very large cell, uploaded as a file; consumed once read."""
    with open(path, encoding="utf-8") as code_file:
        code = code_file.read()
    os.remove(path)
    return code


def _socket_alive(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
    return True

