#!/usr/bin/env python3
"""The in-sandbox half of sandbox-kernel: one self-contained, stdlib-only file.

The kernel uploads this file into the sandbox and uses it in two roles:

* ``runner.py serve DIR`` is a persistent daemon that owns the user's Python
  globals. It runs cells one at a time in its main thread (with IPython when
  importable, with a small ast-based executor otherwise), and those of each kernel
  subshell in a thread of that subshell (IPython only; see Subshell), and keeps every
  output event of a cell in memory, so a client can read them again from any seq.
* its clients are ``runner_client.py run|request DIR B64`` (a separate,
  tiny file: it starts once per cell, see there), started through the sandbox's
  exec API (no stdin) for each cell or operation. They talk to the daemon over
  ``DIR/runner.sock`` and copy its answer, NDJSON, to stdout. B64 is base64 of
  a JSON object, which avoids any quoting problems.

Client/daemon protocol (its words: runner_protocol.py, uploaded next to this
file): the client sends one JSON line ``{"op": ..., ...}``; the daemon answers
with NDJSON lines (the events of a cell, or exactly one reply object) and
closes the connection. A relay's connection (``{"op": "channel"}``, see the
Channel class) stays open instead and carries many requests and tagged events.

Besides the code, a ``run`` request carries what the execute_request asked:
``allow_stdin`` (false: ``input()`` raises StdinNotImplementedError) and
``user_expressions`` (evaluated after the cell, returned in its ``done`` event, which
also carries the cell's ``payload``: pager, next input, edit). A run with a ``comm``
field delivers a frontend's comm message to the comm manager instead of running code,
not queued behind cells but on the event loop (so while a cell awaits); ``comm`` events
are the messages comms in the sandbox send (buffers in base64). ``parent_msg_id`` is
the id of the frontend's request the run answers (its events go out with that parent):
ipywidgets' Output widget captures the output of that id. An output event that answers
another request (a thread's chosen one, see ParentRequests) names it in ``parent``.
One-shot ops ``usage`` and ``comm_info`` answer usage_request and comm_info_request.

Forking: the one-shot op ``fork`` forks the daemon into another sandbox, with the
user's live state; runner_fork.py (uploaded next to this file) does it, asking the
Daemon only to hand over and re-create its own state (Daemon.fork_locks, leave_parent,
take_over).

Must run on Python 3.8+.
"""
from __future__ import annotations

import base64
import json
import os
import socket
import sys

import runner_bundle  # uploaded next to this file, as are the three below: the bundle's hash
import runner_debug  # the debugger
import runner_fork
import runner_protocol as protocol  # sandbox_kernel/runner_protocol.py

SOCKET_NAME = "runner.sock"
READY_NAME = "ready"
NO_IPYTHON_ENV = "SANDBOX_KERNEL_RUNNER_NO_IPYTHON"
FORKABLE_DIR_ENV = "SANDBOX_FORKABLE_DIR"
LOG_NAME = "runner.log"  # where the kernel points the daemon's stdout/stderr (a forked child reopens it)
FORK_ERROR_MESSAGE = "this cell was running when the sandbox was forked; it continues only in the original sandbox"
MAX_CELLS = 200  # beyond this many cells the oldest finished ones are forgotten
# Output floods (a cell printing without end): each cell may show this much output
# (characters of stream text plus the size of displays), then the rest is dropped with
# one notice. Past a burst of OUTPUT_BURST_SECONDS' worth, writers are slowed to the rate
# (bytes per second; 0: no rate limit), as by a slow terminal. The kernel sends its own
# values with each cell.
DEFAULT_OUTPUT_LIMIT = 64 * 1024 * 1024
DEFAULT_OUTPUT_RATE = 8 * 1024 * 1024
OUTPUT_BURST_SECONDS = 4.0
# Events that count against the limit (and are dropped past it); the others (results,
# errors, input requests) are one or few per cell and the kernel needs them.
LIMITED_EVENTS = ("display_data", "update_display_data", "clear_output", "comm")
COMM_MESSAGES = ("comm_open", "comm_msg", "comm_close")
BACKGROUND_RETAINED = 4 * 1024 * 1024  # bytes of between-cell events kept for a channel
BACKGROUND_POLL = 1.0  # seconds a channel's idle threads wait before checking it is still open
# Threads a channel keeps waiting to follow the next cell. Starting a thread per cell took
# 0.6-0.8 ms of the relay's thread, holding the GIL just as the cell's own thread woke to
# run it (timestamps at each hop); handing a cell to a waiting thread is a queue put.
IDLE_FOLLOWERS = 2
# Where pip installs inside the sandbox: on its own disk, kept across kernel restarts.
PACKAGES_PREFIX = "~/.local"
USAGE = "usage: runner.py serve DIR   (clients: runner_client.py)\n"


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "serve":
        return serve(argv[1])
    sys.stderr.write(USAGE)
    return 2


# --------------------------------------------------------------------------
# Daemon
# --------------------------------------------------------------------------


def serve(state_dir: str) -> int:
    _import_daemon_modules()
    Daemon(os.path.abspath(state_dir)).serve_forever()
    return 0


def _import_daemon_modules() -> None:
    """Import the modules the daemon needs (kept out of the module level since clients
    once ran this file too; runner_client.py is the client now)."""
    global ast, builtins, codecs, collections, contextvars, getpass, importlib
    global inspect, io, linecache
    global platform, queue, re, rlcompleter, select, signal, threading, time
    global tokenize, traceback, types, typing
    import ast
    import builtins
    import codecs
    import collections
    import contextvars
    import getpass
    import importlib.machinery
    import importlib.util
    import inspect
    import io
    import linecache
    import platform
    import queue
    import re
    import rlcompleter
    import select
    import signal
    import threading
    import time
    import tokenize
    import traceback
    import types
    import typing


def _import_loop_modules() -> None:
    """asyncio (with concurrent.futures), the largest of the daemon's imports: only the
    engine and the loop cells run on need it, so it comes after the ready file (see
    Daemon.serve_forever); IPython imports it too."""
    global asyncio, concurrent
    import asyncio
    import concurrent.futures


def _look_in_working_directory_first() -> None:
    """Imports look in the working directory first, as in any kernel: '' where Python put
    this script's directory (which holds nothing for user code). Only once the daemon's
    own imports above are done: no file of the user's may stand in for one of them."""
    if sys.path and sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
        sys.path[0] = ""


def _json_default(value: object) -> object:
    # Jupyter carries binary mime data (image/png, ...) as base64 text.
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(value).decode("ascii")
    return repr(value)


def _encode_line(obj: dict) -> bytes:
    # ensure_ascii: the exec API hands our stdout over as text; keep it pure ASCII.
    text = obj.get("text") if obj.get(protocol.TYPE) == protocol.STREAM else None
    if isinstance(text, str):
        # A stream event's text goes last (the kernel publishes it as written here: see
        # runner_protocol), escaped on its own, which is faster than within the dict.
        head = json.dumps({key: value for key, value in obj.items() if key != "text"}, default=_json_default)
        return b"".join((head[:-1].encode("ascii"), b', "text": ', _json_string(text), b"}\n"))
    return (json.dumps(obj, ensure_ascii=True, default=_json_default) + "\n").encode("ascii")


# Below about this many characters json's encoder is quicker than the scans of _json_string
# (measured: equal at 8 KiB, the scans 2.4 times quicker at 64 KiB).
_SCAN_FROM = 8192
# What JSON escapes in ASCII text: control characters, DEL (json.dumps escapes it too), the
# quote and the backslash. The common ones are replaced in _json_string; a text with any
# of the rare ones is left to json's encoder.
_COMMON_ESCAPES = ((b"\\", b"\\\\"), (b'"', b'\\"'), (b"\n", b"\\n"), (b"\r", b"\\r"), (b"\t", b"\\t"))
_RARE_ESCAPES = tuple(bytes([code]) for code in (*range(0x20), 0x7F) if code not in b"\n\r\t")


def _json_string(text: str) -> bytes:
    """`text` as a JSON string, byte for byte what json.encoder.encode_basestring_ascii writes.

    That encoder looks at one character at a time (about 4 ms per MiB here, the runner's
    largest cost in a long print). Output is mostly printable ASCII with newlines, for which
    memchr-speed scans and replaces do the same work in about a quarter of the time.
    """
    if len(text) >= _SCAN_FROM and text.isascii():
        raw = text.encode("ascii")
        if not any(rare in raw for rare in _RARE_ESCAPES):
            for plain, escaped in _COMMON_ESCAPES:  # the backslash first: the others add some
                raw = raw.replace(plain, escaped)
            return b"".join((b'"', raw, b'"'))
    return json.encoder.encode_basestring_ascii(text).encode("ascii")


class Cell:
    """One submitted cell and its events, which clients can (re)read from any seq.

    Events are kept in memory (encoded), so a client whose connection dropped can
    send its `run` again with the last seq it saw and get exactly the events it has
    not seen yet (the exec-per-cell transport's reconnect).
    """

    def __init__(self, cell_id: str, code: str, silent: bool, store_history: bool,
                 execution_count: int | None, budget: OutputBudget):
        self.cell_id = cell_id
        self.budget = budget  # how much more output it may show
        self.code = code
        self.silent = silent
        self.store_history = store_history
        # The kernel's own count, when it numbers cells (magics it handles on the host
        # take numbers too); None lets the runner count.
        self.execution_count = execution_count
        # What the execute_request asked besides the code (set by the daemon when submitted).
        self.allow_stdin = True
        self.user_expressions: dict = {}
        self.comm: dict | None = None  # a frontend's comm message to deliver instead of running code
        self.parent_msg_id: str | None = None  # the frontend request whose output this is
        self.started_count: int | None = None  # its execution count, once it runs
        self.subshell_id: str | None = None  # the kernel subshell it runs in (None: the main shell)
        self.limit_noticed = False  # whether it was told its output is dropped from now on
        self.stored = False  # whether it takes an execution count (known once it runs)
        self.finished = False
        self._lines: list[bytes] = []
        self._changed = threading.Condition()

    def emit(self, type_: str, **fields: object) -> None:
        with self._changed:
            event = {"seq": len(self._lines) + 1, "type": type_}
            event.update(fields)
            line = _encode_line(event)
            self._lines.append(line)
            if type_ == "done":
                self.finished = True
            self._changed.notify_all()

    def read_after(self, after: int, deadline: float | None) -> tuple[list[bytes], bool]:
        """Wait for events with seq > after (or the end of the cell, or the
        monotonic deadline); return them and whether the cell has finished."""
        with self._changed:
            while len(self._lines) <= after and not self.finished:
                timeout = None if deadline is None else deadline - time.monotonic()
                if timeout is not None and timeout <= 0:
                    break
                self._changed.wait(timeout)
            return self._lines[after:], self.finished

    def hold(self) -> None:
        self._changed.acquire()

    def release(self) -> None:
        self._changed.release()

    def reset_after_fork(self) -> None:
        """In a forked child: a new condition (its lock may have been held by a dead thread)."""
        self._changed = threading.Condition()

    def abort_after_fork(self) -> None:
        """In a forked child: the cell did not come along, end it for its clients."""
        self.emit("error", ename="ForkError", evalue=FORK_ERROR_MESSAGE, traceback=[])
        done: dict = {"status": "error"}
        if self.started_count is not None:
            done["execution_count"] = self.started_count
        self.emit("done", **done)
        self.code = ""


class BackgroundLog:
    """Output produced while no cell runs (a thread's print, a subprocess), for the
    channels (see Channel) to pass on: the kernel shows it on the last cell's parent.

    Numbered like a cell's events (seq from 1), with ``"cell": null``; only the newest
    BACKGROUND_RETAINED bytes are kept, for a channel that starts again after its relay
    died. It shares the output cap of the cell that ran last (OutputRouter.end).
    """

    def __init__(self) -> None:
        self.budget = OutputBudget(DEFAULT_OUTPUT_LIMIT, DEFAULT_OUTPUT_RATE)
        self.limit_noticed = False
        self._lines: collections.deque = collections.deque()  # (seq, encoded line)
        self._size = 0
        self.newest = 0
        self._changed = threading.Condition()

    def emit(self, type_: str, **fields: object) -> None:
        with self._changed:
            self.newest += 1
            event = {protocol.CELL: None, protocol.SEQ: self.newest, protocol.TYPE: type_}
            event.update(fields)
            line = _encode_line(event)
            self._lines.append((self.newest, line))
            self._size += len(line)
            while self._size > BACKGROUND_RETAINED and len(self._lines) > 1:
                self._size -= len(self._lines.popleft()[1])
            self._changed.notify_all()

    def read_after(self, after: int, timeout: float) -> list:
        """The retained (seq, line) pairs with seq > after, waiting up to timeout for one."""
        with self._changed:
            if self.newest <= after:
                self._changed.wait(timeout)
            return [(seq, line) for seq, line in self._lines if seq > after]


class FdCapture:
    """Points file descriptors 1 and 2 at pipes, so that what subprocesses,
    ``!cmd`` and C extensions write is captured like Python-level output.

    The originals are kept as the daemon's log (the kernel points them at
    DIR/runner.log). The pipes' read ends are non-blocking: the router drains
    them both from a reader thread and, synchronously, before each Python-level
    write, which keeps ``print`` and ``os.write(1, ...)`` in program order.
    """

    def __init__(self, log_fds: dict | None = None) -> None:
        self.log_fds = log_fds or {"stdout": os.dup(1), "stderr": os.dup(2)}
        self._pipes: dict[int, tuple[str, codecs.IncrementalDecoder]] = {}
        self._waiter = select.poll()  # used by the reader thread only (poll objects aren't thread-safe)
        self._checker = select.poll()  # used under the router's lock
        for fd, name in ((1, "stdout"), (2, "stderr")):
            read_fd, write_fd = os.pipe()
            os.dup2(write_fd, fd)
            os.close(write_fd)
            os.set_blocking(read_fd, False)
            # Incremental decoding never splits a multi-byte character across events.
            self._pipes[read_fd] = (name, codecs.getincrementaldecoder("utf-8")("replace"))
            self._waiter.register(read_fd, select.POLLIN)
            self._checker.register(read_fd, select.POLLIN)

    def close_after_fork(self) -> None:
        """In a forked child: drop the parent's pipes and log fds (never read them:
        what is in the pipes belongs to the parent)."""
        for fd in list(self._pipes) + list(self.log_fds.values()):
            try:
                os.close(fd)
            except OSError:
                pass

    def wait_readable(self) -> None:
        self._waiter.poll()

    def has_output(self) -> bool:
        """Cheap check (one syscall) done before every Python-level write."""
        return bool(self._checker.poll(0))

    def read_available(self) -> list[tuple[str, str]]:
        """(stream name, text) for whatever is in the pipes right now; never blocks."""
        chunks = []
        for fd, _ in self._checker.poll(0):
            name, decoder = self._pipes[fd]
            text = decoder.decode(_read_nonblocking(fd))
            if text:
                chunks.append((name, text))
        return chunks


def _read_nonblocking(fd: int) -> bytes:
    data = []
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            break
        if not chunk:
            break
        data.append(chunk)
    return b"".join(data)


class OutputBudget:
    """How much more a cell may show, and how fast (see DEFAULT_OUTPUT_LIMIT).

    Sizes are characters of stream text and encoded sizes of display events. The
    rate is a token bucket holding OUTPUT_BURST_SECONDS of output: a 20 MB print
    goes out at full speed, an endless one is slowed down before it hits the limit.
    Used under the router's lock.
    """

    def __init__(self, limit: int, rate: int) -> None:
        self.limit = limit
        self.used = 0
        self._rate = rate
        self._capacity = rate * OUTPUT_BURST_SECONDS
        self._tokens = self._capacity
        self._refilled = time.monotonic()

    @classmethod
    def from_request(cls, request: dict) -> "OutputBudget":
        """The kernel's values from a run request; defaults for what is missing or invalid."""
        limit, rate = request.get("output_limit"), request.get("output_rate")
        return cls(limit if _is_int_at_least(limit, 1) else DEFAULT_OUTPUT_LIMIT,
                   rate if _is_int_at_least(rate, 0) else DEFAULT_OUTPUT_RATE)

    def take(self, size: int) -> int:
        """Admit up to size units of output; return how many fit under the limit."""
        allowed = min(size, self.limit - self.used)
        if allowed <= 0:
            return 0
        self.used += allowed
        if self._rate:
            now = time.monotonic()
            self._tokens = min(self._capacity, self._tokens + (now - self._refilled) * self._rate) - allowed
            self._refilled = now
        return allowed

    def delay(self) -> float:
        """Seconds the writer should wait to keep to the rate (0 within it)."""
        return -self._tokens / self._rate if self._rate and self._tokens < 0 else 0.0

    def notice(self) -> str:
        return ("[sandbox-kernel] output limit reached: %s shown, further output of this cell discarded\n"
                % _mebibytes(self.limit))


def _is_int_at_least(value: object, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _mebibytes(size: int) -> str:
    return "%g MiB" % round(size / (1024 * 1024), 2)


class OutputRouter:
    """The single funnel for everything the current cell outputs.

    Stream text is coalesced (at most one flush per FLUSH_INTERVAL, the first at once, or
    past MAX_PENDING characters) because one event per ``print`` would be far too slow; a
    change of stream and every other event flush it first, so the order the
    user's code produced is preserved. Longer writes are cut into events of at
    most MAX_PENDING characters, so no NDJSON line grows without bound. Each
    cell's OutputBudget caps and paces its output, event by event. Output while
    no cell runs goes to the daemon's log. Output that answers another request than
    its sink's (see ParentRequests) names that request's msg_id in its event. A kernel
    subshell's cell runs in its own thread (see Subshell): what that thread writes or
    displays goes to that cell; everything else (other threads, subprocesses through the
    captured fds) to the main shell's cell, or between cells to the background log.
    """

    FLUSH_INTERVAL = 0.01
    # Also the size of the pieces a long write is cut into: big enough that a 20 MB print
    # is a few dozen messages (each costs the kernel and the browser), small enough to bound a line.
    MAX_PENDING = 1024 * 1024

    def __init__(self, capture: FdCapture, parents: ParentRequests):
        self._capture = capture
        self._parents = parents
        self._lock = threading.Lock()
        self._has_pending = threading.Condition(self._lock)
        self._cell: Cell | None = None  # the main shell's
        self._thread_cells: dict[int, Cell] = {}  # subshells' cells, by the thread running them
        self._pending_name = ""
        self._pending_parent: str | None = None
        self._pending_sink: "Cell | BackgroundLog | None" = None
        self._last_flush = 0.0  # when the flusher or an explicit flush last sent pending text
        self._pending: list[str] = []
        self._pending_size = 0
        self._pid = os.getpid()  # a process forked by cell code (multiprocessing) is not this one
        # Where output goes while no cell runs, once a channel listens (else: the log).
        self._background: BackgroundLog | None = None

    def start_threads(self) -> None:
        for target in (self._read_fds_forever, self._flush_forever):
            threading.Thread(target=target, name=target.__name__, daemon=True).start()

    @property
    def current_cell(self) -> Cell | None:
        return self._cell

    @property
    def capture(self) -> FdCapture:
        return self._capture

    def hold(self) -> None:
        """Taken across os.fork() so no other thread is half-way through a change."""
        self._lock.acquire()

    def release(self) -> None:
        self._lock.release()

    def reset_after_fork(self, capture: FdCapture) -> None:
        """In a forked child: new lock and fd capture, same object, so whatever holds
        this router (sys.stdout/stderr, the IPython shell's hooks, the input bridge,
        the engine) emits through the child's machinery without being rebound.
        Pending text stays: it belongs to the current cell."""
        self._capture = capture
        self._lock = threading.Lock()
        self._has_pending = threading.Condition(self._lock)
        self._pid = os.getpid()
        self._background = None  # the parent's channels did not come along

    def background(self) -> BackgroundLog:
        """The log of between-cell output, which channels follow (made on first use)."""
        with self._lock:
            if self._background is None:
                self._background = BackgroundLog()
            return self._background

    def _main_sink(self) -> "Cell | BackgroundLog | None":
        return self._cell if self._cell is not None else self._background

    def _sink(self) -> "Cell | BackgroundLog | None":
        """Where the calling thread's output goes."""
        return self._thread_cells.get(threading.get_ident()) or self._main_sink()

    def cell_here(self) -> Cell | None:
        """The cell whose code the calling thread runs: its subshell's, else the main shell's."""
        return self._thread_cells.get(threading.get_ident()) or self._cell

    def begin(self, cell: Cell) -> None:
        """The cell runs from now on, in the calling thread if it is a subshell's."""
        with self._lock:
            self._absorb_fd_output()  # earlier output belongs to the log, not to this cell
            if cell.subshell_id is not None:
                self._thread_cells[threading.get_ident()] = cell
            else:
                self._cell = cell

    def end(self, cell: Cell) -> None:
        with self._lock:
            self._absorb_fd_output()
            self._flush()
            if cell.subshell_id is not None:
                self._thread_cells.pop(threading.get_ident(), None)
                return
            if self._background is not None and self._cell is not None:
                # What runs on after the cell (a thread, a subprocess) shares its cap.
                self._background.budget = self._cell.budget
                self._background.limit_noticed = False
            self._cell = None

    def write(self, name: str, text: str) -> None:
        """Python-level write to sys.stdout / sys.stderr."""
        if os.getpid() != self._pid:
            # A child forked by cell code (multiprocessing): this router's threads and cell
            # stayed in the daemon, but fds 1 and 2 still lead to its capture pipes.
            _write_all(1 if name == "stdout" else 2, text.encode("utf-8", "replace"))
            return
        parent = self._parents.current()  # the writer's, so asked before taking the lock
        with self._lock:
            if self._capture.has_output():
                self._absorb_fd_output()
            self._append(name, text, parent, self._sink())

    def emit(self, type_: str, **fields: object) -> None:
        """A non-stream event of the current cell (dropped outside cells)."""
        parent = self._parents.current()
        with self._lock:
            self._absorb_fd_output()
            self._flush()
            sink = self._sink()
            if sink is None:
                self.log("dropped a %s event produced outside of any cell\n" % type_)
                return
            fields.update(self._parent_field(sink, parent))
            if type_ not in LIMITED_EVENTS:
                sink.emit(type_, **fields)
                return
            size = len(_encode_line(fields))
            if sink.budget.take(size) < size:
                self._notice_limit(sink)
                return
            sink.emit(type_, **fields)
            self._pace(sink)

    def log(self, text: str) -> None:
        _write_all(self._capture.log_fds["stderr"], text.encode("utf-8", "replace"))

    @staticmethod
    def _parent_field(sink: "Cell | BackgroundLog", parent: str | None) -> dict:
        """The event's parent, when it is not its sink's own (a cell's parent_msg_id; between
        cells, the kernel's default is the last cell's, which the event may not answer)."""
        if parent is None or (isinstance(sink, Cell) and parent == sink.parent_msg_id):
            return {}
        return {protocol.PARENT: parent}

    def _absorb_fd_output(self) -> None:
        for name, text in self._capture.read_available():
            # No thread of ours wrote it: the main shell's.
            self._append(name, text, self._parents.global_parent, self._main_sink())

    def _append(self, name: str, text: str, parent: str | None, sink: "Cell | BackgroundLog | None") -> None:
        if not text:
            return
        if sink is None:
            _write_all(self._capture.log_fds[name], text.encode("utf-8", "replace"))
            return
        if len(text) > self.MAX_PENDING:  # a long write goes in pieces: no event is huge
            for start in range(0, len(text), self.MAX_PENDING):
                self._append(name, text[start:start + self.MAX_PENDING], parent, sink)
            return
        if self._pending and (name != self._pending_name or parent != self._pending_parent
                              or sink is not self._pending_sink):
            self._flush()
        if not self._pending:
            self._has_pending.notify()
        self._pending_name = name
        self._pending_parent = parent
        self._pending_sink = sink
        self._pending.append(text)
        self._pending_size += len(text)
        if self._pending_size >= self.MAX_PENDING:
            self._flush()

    def _flush(self) -> None:
        """The pending text as one stream event, as far as the cell's budget allows.
        (The budget is charged here, per event, not per write: print stays cheap.)"""
        if not self._pending:
            return
        text = "".join(self._pending)
        self._pending = []
        self._pending_size = 0
        sink, self._pending_sink = self._pending_sink, None
        if sink is None:
            return
        allowed = sink.budget.take(len(text))
        if allowed:
            sink.emit("stream", name=self._pending_name, text=text if allowed == len(text) else text[:allowed],
                      **self._parent_field(sink, self._pending_parent))
        if allowed < len(text):
            self._notice_limit(sink)
        self._pace(sink)

    @staticmethod
    def _notice_limit(sink: "Cell | BackgroundLog") -> None:
        """Tell the cell, once, that its output is being dropped from now on."""
        if not sink.limit_noticed:
            sink.limit_noticed = True
            sink.emit("stream", name="stderr", text=sink.budget.notice())

    @staticmethod
    def _pace(sink: "Cell | BackgroundLog") -> None:
        """Keep the cell to its output rate by waiting here, holding the lock: every
        source of output (print, display, the fd reader and so subprocesses) waits too.
        An interrupt lands in this sleep, or in the wait for the lock, as anywhere."""
        delay = sink.budget.delay()
        if delay:
            time.sleep(delay)

    def flush_now(self) -> None:
        """An explicit flush (``print(..., flush=True)``): the pending text goes at once, as
        under ipykernel, unless an event went less than FLUSH_INTERVAL ago; then the flusher
        thread sends it at the interval's end, so a loop that flushes every line is still
        at most one event per interval."""
        with self._lock:
            if time.monotonic() - self._last_flush >= self.FLUSH_INTERVAL:
                self._flush()
                self._last_flush = time.monotonic()

    def _flush_forever(self) -> None:
        # Unflushed text waits out the interval: a tight print loop is one event per interval,
        # and the prints of a quick cell are one output, as ipykernel's batching makes them
        # (a saved notebook's outputs do not depend on which kernel ran it).
        while True:
            with self._has_pending:
                while not self._pending:
                    self._has_pending.wait()
            time.sleep(self.FLUSH_INTERVAL)
            with self._lock:
                self._flush()
                self._last_flush = time.monotonic()

    def _read_fds_forever(self) -> None:
        while True:
            self._capture.wait_readable()
            with self._lock:
                self._absorb_fd_output()


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def _make_cell_stream(router: OutputRouter, name: str, fd: int) -> io.TextIOBase:
    """A sys.stdout / sys.stderr replacement that feeds the router."""

    class CellStream(io.TextIOBase):
        encoding = "utf-8"
        errors = "replace"

        def __init__(self) -> None:
            super().__init__()
            # Binary writes go straight to the (captured) fd, unbuffered so they keep their place.
            self.buffer = open(fd, "wb", buffering=0, closefd=False)

        def write(self, text: str) -> int:
            if not isinstance(text, str):
                raise TypeError("write() argument must be str, not %s" % type(text).__name__)
            router.write(name, text)
            return len(text)

        def flush(self) -> None:
            router.flush_now()

        def writable(self) -> bool:
            return True

        def fileno(self) -> int:
            return fd  # fds 1 and 2 are captured as well, for libraries that want a real fd

        def isatty(self) -> bool:
            return False

    return CellStream()


class ParentRequests:
    """Which frontend request output now answers (its msg_id), as ipykernel's shell tells it
    (get_parent, set_parent, set_thread_parent): a context variable, falling back to a global
    one. Each cell sets both when it starts; between cells the global stays the last cell's,
    where the kernel shows a background thread's output. A thread may choose its own (the
    context variable is per thread), and an asyncio task keeps the one of the cell that
    made it (a task copies the context it is made in). The router tags output with it.
    ipywidgets' Output widget asks its comm's ``kernel`` for it and captures output by it."""

    def __init__(self) -> None:
        self._context: contextvars.ContextVar[str | None] = contextvars.ContextVar("sandbox_kernel_parent")
        self._global: str | None = None

    def enter(self, msg_id: str | None, between_cells: bool) -> contextvars.Token:
        """A run starts (a cell, or a frontend's comm message): its output answers msg_id."""
        if between_cells:
            self._global = msg_id
        return self._context.set(msg_id)

    def leave(self, token: contextvars.Token) -> None:
        self._context.reset(token)

    def current(self) -> str | None:
        """The msg_id output made here and now answers."""
        try:
            return self._context.get()
        except LookupError:
            return self._global

    @property
    def global_parent(self) -> str | None:
        """For output of no particular thread (a subprocess's, through the captured fds)."""
        return self._global

    # ipykernel's shell API (the IPython shell delegates to these; see _build_ipython_shell)

    def get_parent(self) -> dict:
        msg_id = self.current()
        return {"header": {"msg_id": msg_id}} if msg_id else {}

    def set_parent(self, parent: object) -> None:
        """This thread's output, and that of threads which chose none, goes to parent's request."""
        msg_id = _msg_id_of(parent)
        self._context.set(msg_id)
        self._global = msg_id

    def set_thread_parent(self, parent: object) -> contextvars.Token:
        """Only this thread's (or task's) output goes to parent's request, until reset."""
        return self._context.set(_msg_id_of(parent))

    def reset_thread_parent(self, token: contextvars.Token) -> None:
        self._context.reset(token)


def _msg_id_of(parent: object) -> str | None:
    """The msg_id of a message or of a header (what get_parent gives), or None."""
    if not isinstance(parent, dict):
        return None
    header = parent.get("header", parent)
    msg_id = header.get("msg_id") if isinstance(header, dict) else None
    return msg_id if isinstance(msg_id, str) and msg_id else None


class CommBridge:
    """Jupyter comms in the sandbox (ipywidgets and the like), through the `comm` package
    when it is installed: its create_comm and get_comm_manager are pointed here. What a
    comm sends becomes a `comm` event of the running cell (buffers as base64); what the
    frontend sends arrives as a run whose request has a `comm` field (Daemon._deliver_comm),
    so handlers run in the main thread, and their events have that run's parent."""

    def __init__(self, router: OutputRouter, parents: ParentRequests):
        self.manager = None
        try:
            import comm
            from comm.base_comm import BaseComm, CommManager
        except ImportError:
            return

        class EventComm(BaseComm):
            kernel = parents  # all of ipykernel's kernel that comm users ask for

            def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys):
                content = dict(keys, data=data if data is not None else {}, comm_id=self.comm_id)
                router.emit(protocol.COMM, msg_type=msg_type, content=content, metadata=metadata or {},
                            buffers=[base64.b64encode(bytes(buffer)).decode("ascii") for buffer in buffers or []])

        # Libraries pick widgets over text by whether ipykernel's shell module is loaded
        # (tqdm.auto does): here comms reach the frontend, so widgets are the right pick.
        # Stand-ins say so without the cost of importing ipykernel into every sandbox.
        defer_import("ipykernel", "ipykernel.zmqshell")
        self.manager = CommManager()
        comm.create_comm = EventComm
        comm.get_comm_manager = lambda: self.manager

    def deliver(self, message: dict) -> None:
        """The frontend's comm_open, comm_msg or comm_close (validated by the daemon)."""
        if self.manager is None:
            return  # no comm package in this sandbox: nothing can be listening
        msg = {"header": {"msg_type": message["msg_type"]}, "parent_header": {}, "metadata": message["metadata"],
               "content": message["content"], "buffers": [memoryview(buffer) for buffer in message["buffers"]]}
        getattr(self.manager, message["msg_type"])(None, None, msg)

    def info(self, target_name: object) -> dict:
        """comm_info_reply's comms: the open ones, of one target or all."""
        if self.manager is None:
            return {}
        return {comm_id: {"target_name": comm.target_name} for comm_id, comm in list(self.manager.comms.items())
                if target_name is None or comm.target_name == target_name}


def defer_import(package: str, module: str) -> None:
    """Put stand-ins for `package` and its `module` in sys.modules, each imported for real
    on the first use of a name it does not have (ipykernel costs ~16 MiB and ~0.1 s of
    start, in every sandbox). `name in sys.modules`, find_spec and __file__ answer as for
    the real modules; `import package.module` and `from package.module import x` work as
    usual. Nothing is done if the package is not installed or already imported."""
    if package in sys.modules or module in sys.modules:
        return
    package_spec = importlib.util.find_spec(package)  # a top-level name: imports nothing
    if package_spec is None or not package_spec.submodule_search_locations:
        return
    module_spec = importlib.machinery.PathFinder.find_spec(module, package_spec.submodule_search_locations)
    if module_spec is None:
        return

    class StandIn(types.ModuleType):
        def __getattr__(self, attribute: str) -> object:
            name = self.__name__
            if sys.modules.get(name) is self:
                del sys.modules[name]
            real = importlib.import_module(name)  # a stand-in package is imported by the machinery first
            for key, value in list(vars(self).items()):
                if isinstance(value, StandIn):  # a stand-in module stays reachable from its real package
                    vars(real).setdefault(key, value)
            self.__dict__.update(real.__dict__)
            return getattr(real, attribute)

    for spec in (package_spec, module_spec):
        stand_in = StandIn(spec.name)
        stand_in.__spec__, stand_in.__loader__, stand_in.__file__ = spec, spec.loader, spec.origin
        sys.modules[spec.name] = stand_in
    setattr(sys.modules[package], module.rpartition(".")[2], sys.modules[module])


def _comm_message(request: object) -> dict | None:
    """A frontend comm message from a run request, checked, buffers decoded; None if absent."""
    if request is None:
        return None
    if not (isinstance(request, dict) and request.get("msg_type") in COMM_MESSAGES
            and isinstance(request.get("content"), dict) and isinstance(request["content"].get("comm_id"), str)):
        raise ValueError("a comm request needs msg_type (comm_open/msg/close) and content with a comm_id")
    buffers = request.get("buffers") or []
    metadata = request.get("metadata") or {}
    if not isinstance(buffers, list) or not all(isinstance(buffer, str) for buffer in buffers) \
            or not isinstance(metadata, dict):
        raise ValueError("comm buffers must be base64 strings and metadata an object")
    return {"msg_type": request["msg_type"], "content": request["content"], "metadata": metadata,
            "buffers": [base64.b64decode(buffer) for buffer in buffers]}


class InputBridge:
    """``input()`` and ``getpass.getpass()`` for user code.

    There is no stdin: asking emits an input_request event and blocks until
    the kernel answers through ``request {"op": "input"}``. An interrupt
    raises KeyboardInterrupt out of the wait like out of any blocking call.
    """

    def __init__(self, router: OutputRouter):
        self._router = router
        self._lock = threading.Lock()
        # The questions waiting for an answer, by cell (a subshell's cell may ask too).
        self._pending: dict[str, tuple[threading.Event, list[str | None]]] = {}
        self._no_stdin = _stdin_not_implemented()

    def install(self) -> None:
        builtins.input = self.input
        getpass.getpass = self.getpass

    def reset_after_fork(self) -> None:
        # A pending question belonged to a cell that did not come along.
        self._lock = threading.Lock()
        self._pending = {}

    # __tracebackhide__ keeps these frames out of IPython tracebacks: an error in
    # input() should point at the user's call, not at the runner.
    def input(self, prompt: object = "") -> str:
        __tracebackhide__ = True
        return self._ask(str(prompt), password=False)

    def getpass(self, prompt: str = "Password: ", stream: object = None) -> str:
        __tracebackhide__ = True
        return self._ask(prompt, password=True)

    def answer(self, cell_id: str, value: str | None) -> bool:
        """Deliver the answer; None means the frontend cannot answer (input() raises EOFError)."""
        with self._lock:
            question = self._pending.pop(cell_id, None)
        if question is None:
            return False
        answered, box = question
        box.append(value)
        answered.set()
        return True

    def _ask(self, prompt: str, password: bool) -> str:
        __tracebackhide__ = True
        cell = self._router.cell_here()
        if cell is None:
            raise EOFError("input is only available while a cell runs")
        if not cell.allow_stdin:  # the execute_request said so: fail at once, as ipykernel does
            raise self._no_stdin("raw_input was called, but this frontend does not support input requests.")
        answered = threading.Event()
        box: list[str | None] = []
        with self._lock:
            self._pending[cell.cell_id] = (answered, box)
        try:
            self._router.emit("input_request", prompt=prompt, password=password)
            answered.wait()
        finally:
            with self._lock:
                self._pending.pop(cell.cell_id, None)
        if box[0] is None:
            raise EOFError("input() is not available: this frontend does not accept input")
        return box[0]


def _stdin_not_implemented() -> type:
    """IPython's StdinNotImplementedError (what ipykernel raises), or a stand-in without IPython."""
    try:
        from IPython.core.error import StdinNotImplementedError
    except ImportError:
        class StdinNotImplementedError(NotImplementedError):
            pass
    return StdinNotImplementedError


class CellTask:
    """The asyncio task of the main shell's cell running now, while it awaits (top-level
    await), so that an interrupt can cancel it (Daemon._on_interrupt). A subshell's cell
    (in another thread) is not interrupted, as under ipykernel, where SIGINT reaches only
    the main thread."""

    current: "asyncio.Future | None" = None

    @classmethod
    async def run(cls, coroutine) -> object:
        task = asyncio.ensure_future(coroutine)
        if threading.current_thread() is not threading.main_thread():
            return await task
        cls.current = task
        try:
            return await task
        finally:
            cls.current = None


# ----------------------------------------------------------- plain engine


def _mime_bundle(obj: object) -> dict:
    """Jupyter mime bundle of ``obj`` from its ``_repr_*_`` methods (IPython-less)."""
    data: dict = {}
    if not isinstance(obj, type):  # on a class these would be unbound methods
        mimebundle = getattr(obj, "_repr_mimebundle_", None)
        if callable(mimebundle):
            bundle = mimebundle(include=None, exclude=None)
            data.update(bundle[0] if isinstance(bundle, tuple) else bundle or {})
        for mime, method_name in _REPR_METHODS:
            method = getattr(obj, method_name, None)
            value = method() if callable(method) else None
            if isinstance(value, tuple):  # (data, metadata)
                value = value[0]
            if value is not None and mime not in data:
                data[mime] = value
    data.setdefault("text/plain", repr(obj))
    return data


_REPR_METHODS = (
    ("text/html", "_repr_html_"),
    ("text/markdown", "_repr_markdown_"),
    ("text/latex", "_repr_latex_"),
    ("image/svg+xml", "_repr_svg_"),
    ("image/png", "_repr_png_"),
    ("image/jpeg", "_repr_jpeg_"),
    ("application/json", "_repr_json_"),
    ("application/javascript", "_repr_javascript_"),
)


def _ends_with_semicolon(code: str) -> bool:
    """True if the last token of the cell is ';' (which silences its result)."""
    skipped = (tokenize.ENDMARKER, tokenize.NEWLINE, tokenize.NL, tokenize.COMMENT,
               tokenize.INDENT, tokenize.DEDENT)
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(code).readline))
    except (tokenize.TokenError, SyntaxError):
        return False
    for token in reversed(tokens):
        if token.type not in skipped:
            return token.type == tokenize.OP and token.string == ";"
    return False


def _name_at(code: str, cursor_pos: int) -> str:
    """The dotted name under (or just before) the cursor; inside ``f(`` it is ``f``."""
    def is_name_char(char: str) -> bool:
        return char.isalnum() or char == "_"

    start = end = cursor_pos
    while end < len(code) and is_name_char(code[end]):
        end += 1
    while start > 0 and (is_name_char(code[start - 1]) or code[start - 1] == "."):
        start -= 1
    name = code[start:end].strip(".")
    if not name and cursor_pos > 0 and code[cursor_pos - 1] == "(":
        return _name_at(code, cursor_pos - 1)
    return name


# In the plain mode, lines in IPython's shell syntax: `!command` and `%pip ...`.
_SHELL_LINE_PATTERN = r"^([ \t]*)(!|%pip\b)(.*)$"


class PlainEngine:
    """Runs cells without IPython.

    Statements run in order; a final expression is evaluated and becomes the
    execute_result. Each cell gets a ``<cell-N>`` filename registered in
    linecache so tracebacks show its source, and the daemon's own frames are
    stripped from them. Open pyplot figures are shown as PNGs after each cell.
    """

    ipython_version = None

    def __init__(self, router: OutputRouter):
        self._router = router
        # A fresh __main__ module, so that pickling classes defined in cells works.
        main_module = types.ModuleType("__main__")
        main_module.__dict__["__builtins__"] = builtins
        sys.modules["__main__"] = main_module
        self.namespace = main_module.__dict__
        self.execution_count = 1  # the count the next stored cell gets
        self._cells_run = 0
        builtins.display = self.display
        builtins._sandbox_kernel_shell = _shell  # what `!command` lines become (_shell_call)
        builtins._sandbox_kernel_expand = _expand  # what the kernel's magics call for `{expr}`

    def reset_after_fork(self) -> None:
        pass

    async def run(self, code: str, silent: bool, store_history: bool, count: int) -> bool:
        self._cells_run += 1
        filename = "<cell-%d>" % self._cells_run
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        if store_history:
            self.execution_count += 1
        try:
            value = await self._execute(code, filename)
            if value is not None and not silent and not _ends_with_semicolon(code):
                self.namespace["_"] = value
                self._router.emit("execute_result", execution_count=count,
                                  data=_mime_bundle(value), metadata={})
            ok = True
        except BaseException:  # noqa: B902 - SystemExit and KeyboardInterrupt are user errors here
            self._report_error(*sys.exc_info())
            ok = False
        self._show_figures()
        return ok

    def user_expressions(self, expressions: dict) -> dict:
        """Each expression's value as a mime bundle, or its error (execute_reply's user_expressions)."""
        results = {}
        for key, expression in expressions.items():
            try:
                results[key] = {"status": "ok", "data": _mime_bundle(eval(expression, self.namespace)), "metadata": {}}
            except Exception as exc:
                results[key] = {"status": "error", "ename": type(exc).__name__, "evalue": str(exc),
                                "traceback": traceback.format_exception_only(type(exc), exc)}
        return results

    def take_payload(self) -> list:
        return []  # pager, set_next_input: IPython features

    def display(self, *objs: object, display_id: str | None = None, update: bool = False,
                metadata: dict | None = None, **_ignored: object) -> None:
        """The ``display()`` builtin of the IPython-less mode."""
        transient = {"display_id": display_id} if display_id else {}
        for obj in objs:
            self._router.emit("update_display_data" if update else "display_data",
                              data=_mime_bundle(obj), metadata=metadata or {}, transient=transient)

    def complete(self, code: str, cursor_pos: int) -> dict:
        start = cursor_pos
        while start > 0 and (code[start - 1].isalnum() or code[start - 1] in "_."):
            start -= 1
        text = code[start:cursor_pos]
        matches: list[str] = []
        if text:  # rlcompleter answers a tab character for empty text
            completer = rlcompleter.Completer(self.namespace)
            try:
                for state in range(10000):
                    match = completer.complete(text, state)
                    if match is None:
                        break
                    match = match.rstrip("(")
                    if match not in matches:
                        matches.append(match)
            except Exception:  # e.g. the running cell changed the namespace under us
                pass
        return {"matches": matches, "cursor_start": start, "cursor_end": cursor_pos, "metadata": {}}

    def inspect(self, code: str, cursor_pos: int, detail_level: int) -> dict:
        name = _name_at(code, cursor_pos)
        try:
            obj = self._lookup(name)
        except (KeyError, AttributeError):
            return {"found": False, "data": {}, "metadata": {}}
        return {"found": True, "data": {"text/plain": _describe(name, obj, detail_level)}, "metadata": {}}

    def _lookup(self, dotted_name: str) -> object:
        """Resolve a dotted name by plain lookups (never evaluating code)."""
        if not dotted_name:
            raise KeyError(dotted_name)
        first, *rest = dotted_name.split(".")
        obj = self.namespace[first] if first in self.namespace else vars(builtins)[first]
        for attribute in rest:
            obj = getattr(obj, attribute)
        return obj

    async def _execute(self, code: str, filename: str) -> object:
        """Run the cell (top-level await allowed); return the value of its final expression, if any."""
        code = re.sub(_SHELL_LINE_PATTERN, _shell_call, code, flags=re.MULTILINE)
        # dont_inherit: this file's __future__ imports must not leak into user code.
        tree = compile(code, filename, "exec", ast.PyCF_ONLY_AST, dont_inherit=True)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        await self._evaluate(compile(tree, filename, "exec", ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True))
        if last is None:
            return None
        expression = ast.Expression(last.value)
        return await self._evaluate(compile(expression, filename, "eval", ast.PyCF_ALLOW_TOP_LEVEL_AWAIT,
                                            dont_inherit=True))

    async def _evaluate(self, compiled: types.CodeType) -> object:
        """Run compiled cell code; code with a top-level await is a coroutine to await."""
        outcome = eval(compiled, self.namespace)
        if compiled.co_flags & inspect.CO_COROUTINE:
            return await CellTask.run(outcome)
        return outcome

    def _report_error(self, etype: type, value: BaseException, tb: types.TracebackType | None) -> None:
        while tb is not None and tb.tb_frame.f_code.co_filename == _THIS_FILE:
            tb = tb.tb_next  # the user's cell is where their traceback starts
        if issubclass(etype, SyntaxError):
            lines = traceback.format_exception_only(etype, value)
        else:
            lines = traceback.format_exception(etype, value, tb)
        self._router.emit("error", ename=etype.__name__, evalue=str(value),
                          traceback=[line.rstrip("\n") for line in lines])

    def _show_figures(self) -> None:
        """Emit open pyplot figures as PNG (what matplotlib-inline does with IPython)."""
        pyplot = sys.modules.get("matplotlib.pyplot")
        if pyplot is None:  # never import matplotlib on the user's behalf
            return
        try:
            for number in pyplot.get_fignums():
                figure = pyplot.figure(number)
                png = io.BytesIO()
                figure.savefig(png, format="png", bbox_inches="tight")
                self._router.emit("display_data", data={"image/png": png.getvalue(), "text/plain": repr(figure)},
                                  metadata={}, transient={})
        except Exception:
            self._router.write("stderr", traceback.format_exc())
        finally:
            pyplot.close("all")


def _shell_call(match) -> str:
    """A `!command` or `%pip ...` line (IPython syntax) as a call of _shell, line numbers kept."""
    indent, escape, rest = match.groups()
    return "%s_sandbox_kernel_shell(%r, %r, globals())" % (indent, rest.strip(), escape == "%pip")


def _expand(line: str, names: dict) -> str:
    """`$name` and `{expr}` in a shell or magic line, evaluated in the user's names (IPython's
    var_expand, for the plain mode); as there, the line as it was when one fails."""
    try:
        named = re.sub(r"\$(\w+)", lambda m: str(names[m.group(1)]) if m.group(1) in names else m.group(0), line)
        return re.sub(r"\{([^{}]+)\}", lambda m: str(eval(m.group(1), names)), named)
    except Exception:
        return line


def _shell(command: str, pip: bool, names: dict) -> None:
    """`!command` and `%pip ...` in the plain mode: the shell runs them, their output is the
    cell's (fds 1 and 2). pip runs from the interpreter's bundled wheel (ensurepip) when the
    rootfs has no pip of its own."""
    import shlex
    import subprocess

    command = _expand(command, names)
    env = None
    if pip:
        command = "%s -m pip %s" % (shlex.quote(sys.executable), command)
        if not _importable("pip"):
            wheel = _bundled_pip()
            if wheel is None:
                sys.stderr.write("pip is not available in this sandbox (no pip module, no ensurepip)\n")
                return
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([wheel, os.environ.get("PYTHONPATH", "")]))
    subprocess.run(command, shell=True, env=env)


def _bundled_pip() -> str | None:
    try:
        import ensurepip
    except ImportError:
        return None
    import glob

    # Debian's Python keeps the wheels its ensurepip installs in /usr/share/python-wheels, not
    # beside ensurepip.
    for place in (os.path.join(os.path.dirname(ensurepip.__file__), "_bundled"), "/usr/share/python-wheels"):
        wheels = sorted(glob.glob(os.path.join(place, "pip-*.whl")))
        if wheels:
            return wheels[-1]
    return None


def _describe(name: str, obj: object, detail_level: int) -> str:
    """pydoc-like text for inspect requests: signature, type, docstring (and source)."""
    lines = []
    try:
        lines.append("Signature: %s%s" % (name, inspect.signature(obj)))
    except (TypeError, ValueError):
        pass
    lines.append("Type:      %s" % type(obj).__name__)
    doc = inspect.getdoc(obj)
    if doc:
        lines.append("Docstring:\n" + doc)
    if detail_level:
        try:
            lines.append("Source:\n" + inspect.getsource(obj))
        except (OSError, TypeError):
            pass
    return "\n".join(lines)


def _event_loop_files() -> tuple:
    """Where the event loop's own code lives (asyncio, selectors): a signal that arrives
    there found the main thread idle in the loop."""
    import selectors

    return (os.path.dirname(asyncio.__file__) + os.sep, selectors.__file__)


def _this_file() -> str:
    """The filename this file's frames carry (to strip them from tracebacks)."""
    return _this_file.__code__.co_filename


_THIS_FILE = _this_file()


# --------------------------------------------------------- IPython engine


class IPythonEngine:
    """Runs cells with a full IPython InteractiveShell (magics, ``!cmd``, rich
    display, IPython tracebacks) whose output machinery emits events."""

    def __init__(self, router: OutputRouter, parents: ParentRequests):
        import IPython

        self.ipython_version = IPython.__version__
        self._count = 0
        self.shell = _build_ipython_shell(router.emit, lambda: self._count, parents)

    def reset_after_fork(self) -> None:
        # The history manager's locks may have been held by the parent's main thread.
        history = self.shell.history_manager
        for name in ("db_input_cache_lock", "db_output_cache_lock"):
            if hasattr(history, name):
                setattr(history, name, threading.Lock())

    @property
    def execution_count(self) -> int:
        return self.shell.execution_count

    @execution_count.setter
    def execution_count(self, count: int) -> None:
        self.shell.execution_count = count
        # Numbers the kernel gave to cells that did not run here (its own magics, an empty
        # cell): blank history entries, so that In[n], %history and %recall n find cell n.
        history = self.shell.history_manager
        for inputs in (history.input_hist_parsed, history.input_hist_raw):
            inputs.extend([""] * (count - len(inputs)))

    async def run(self, code: str, silent: bool, store_history: bool, count: int) -> bool:
        """Run a cell on the daemon's event loop: a cell with top-level await as a task
        (what ipykernel does), any other synchronously."""
        from IPython.core.interactiveshell import _asyncio_runner

        self._count = count
        shell = self.shell
        shell.displayhook_failed = False
        try:
            transformed, transform_error = shell.transform_cell(code), None
        except Exception:
            transformed, transform_error = code, sys.exc_info()
        if shell.loop_runner is _asyncio_runner and shell.should_run_async(
                code, transformed_cell=transformed, preprocessing_exc_tuple=transform_error):
            result = None
            try:
                result = await CellTask.run(shell.run_cell_async(
                    code, store_history=store_history, silent=silent, transformed_cell=transformed,
                    preprocessing_exc_tuple=transform_error))
            finally:  # what run_cell does after run_cell_async
                shell.events.trigger("post_execute")
                if not silent:
                    shell.events.trigger("post_run_cell", result)
        else:
            result = shell.run_cell(code, store_history=store_history, silent=silent)
        # An error formatting the cell's result fails the cell, as under ipykernel.
        return result.success and not shell.displayhook_failed

    def user_expressions(self, expressions: dict) -> dict:
        return self.shell.user_expressions(expressions)

    def take_payload(self) -> list:
        """What the cell asked of the frontend (pager, next input): the execute_reply's payload."""
        payload = self.shell.payload_manager.read_payload()
        self.shell.payload_manager.clear_payload()
        return payload

    def complete(self, code: str, cursor_pos: int) -> dict:
        # The provisional completions API (what ipykernel uses): unlike the
        # older shell.complete() it still finds user names when jedi is installed.
        from IPython.core.completer import provisionalcompleter, rectify_completions

        with provisionalcompleter():
            completions = list(rectify_completions(code, self.shell.Completer.completions(code, cursor_pos)))
        start, end = (completions[0].start, completions[0].end) if completions else (cursor_pos, cursor_pos)
        return {"matches": [completion.text for completion in completions], "cursor_start": start,
                "cursor_end": end, "metadata": {}}

    def inspect(self, code: str, cursor_pos: int, detail_level: int) -> dict:
        from IPython.utils.tokenutil import token_at_cursor

        name = token_at_cursor(code, cursor_pos)
        try:
            bundle = self.shell.object_inspect_mime(name, detail_level=detail_level)
        except KeyError:
            return {"found": False, "data": {}, "metadata": {}}
        bundle.pop("text/html", None)  # like ipykernel without an HTML pager
        return {"found": True, "data": bundle, "metadata": {}}


def _build_ipython_shell(emit, current_count, parents: ParentRequests):
    """An InteractiveShell whose displays, results and tracebacks become events
    (the same hooks ipykernel's ZMQInteractiveShell uses), with ipykernel's shell API
    that tells which request output goes to (get_parent, set_parent, set_thread_parent)."""
    from IPython.core.displayhook import DisplayHook
    from IPython.core.displaypub import DisplayPublisher
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets import Type
    from traitlets.config import Config

    class EventDisplayPublisher(DisplayPublisher):
        def publish(self, data, metadata=None, source=None, *, transient=None, update=False, **kwargs):
            emit("update_display_data" if update else "display_data",
                 data=data, metadata=metadata or {}, transient=transient or {})

        def clear_output(self, wait=False):
            emit("clear_output", wait=bool(wait))

    class EventDisplayHook(DisplayHook):
        """The value of a cell's last expression becomes an execute_result."""

        _bundle = None  # while formatting a result

        def start_displayhook(self):
            self._bundle = ({}, {})

        def write_output_prompt(self):
            pass  # no "Out[N]:" text: the count travels in the event

        def write_format_data(self, format_dict, md_dict=None):
            self._bundle = (format_dict, md_dict or {})

        def finish_displayhook(self):
            data, metadata = self._bundle
            self._bundle = None
            if data:
                emit("execute_result", execution_count=current_count(), data=data, metadata=metadata)

        def quiet(self):
            # The base class looks at the history, which cells run with
            # store_history=False never reach; look at this cell instead.
            if self.exec_result is None:
                return super().quiet()
            return _ends_with_semicolon(self.exec_result.info.raw_cell)

    class EventShell(InteractiveShell):
        displayhook_class = Type(EventDisplayHook)
        display_pub_class = Type(EventDisplayPublisher)
        displayhook_failed = False  # a result's formatting raised, in the cell running now

        def init_hooks(self):
            super().init_hooks()
            # `obj?`, `%pdoc`, `%pinfo`...: a `page` payload for the frontend's pager.
            self.set_hook("show_in_pager", _page_payload, 99)

        def set_next_input(self, s, replace=False):
            # `%load`, `%recall`: the frontend puts the text in the next input (or this one).
            self.payload_manager.write_payload({"source": "set_next_input", "text": s, "replace": replace})

        def _showtraceback(self, etype, evalue, stb):
            if self.displayhook._bundle is not None:
                self.displayhook_failed = True
            # IPython always shows the frame that raised, even a runner one (input()
            # without a frontend, say): drop every frame of this file.
            user_frames = [entry for entry in stb if _THIS_FILE not in re.sub(r"\x1b\[[0-9;]*m", "", entry)]
            emit("error", ename=etype.__name__, evalue=str(evalue), traceback=user_frames)

        def ask_exit(self):
            # exit()/quit() in a cell must not end the daemon; the frontend is told
            # instead (an ask_exit payload), as ipykernel does.
            emit("ask_exit")

        def get_parent(self):
            return parents.get_parent()

        def set_parent(self, parent):
            parents.set_parent(parent)

        def set_thread_parent(self, parent):
            return parents.set_thread_parent(parent)

        def reset_thread_parent(self, token):
            parents.reset_thread_parent(token)

        def enable_gui(self, gui=None):
            if gui not in (None, "inline"):
                raise NotImplementedError("GUI event loop %r is not available in the sandbox" % gui)

    config = Config()
    config.HistoryManager.hist_file = ":memory:"  # no sqlite file, no history-saving thread
    shell = EventShell.instance(config=config)
    _use_interruptible_pdb()
    _register_edit_magic(shell)
    return shell


def _register_edit_magic(shell) -> None:
    """%edit (and its alias %ed) as under ipykernel: no editor in the sandbox to wait for (IPython's own
    would start one without a terminal), so the frontend is told which file to open, an
    `edit_magic` payload, and nothing runs. The path is the sandbox's."""
    from IPython.core.magic import Magics, line_magic, magics_class
    from IPython.core.magics.code import CodeMagics, MacroToEdit

    @magics_class
    class EditMagics(Magics):
        @line_magic
        def edit(self, parameter_s=""):
            opts, args = self.parse_options(parameter_s, "prn:")
            try:
                filename, line_number, _ = CodeMagics._find_edit_target(self.shell, args, opts, ["", ""])
            except MacroToEdit:
                print("%edit of a macro is not available in a kernel")
                return
            self.shell.payload_manager.write_payload({"source": "edit_magic", "line_number": line_number,
                                                      "filename": os.path.abspath(filename)})

    shell.register_magics(EditMagics)


def _page_payload(shell, data, start=0, screen_lines=0):
    """The show_in_pager hook: text or a mime bundle for the frontend's pager."""
    bundle = dict(data) if isinstance(data, dict) else {"text/plain": str(data)}
    bundle.pop("text/html", None)  # no HTML pager, as in ipykernel by default
    shell.payload_manager.write_payload({"source": "page", "data": bundle, "start": start})


def _use_interruptible_pdb() -> None:
    """pdb.set_trace() and breakpoint() get IPython's debugger that an interrupt ends
    (plain pdb would swallow the KeyboardInterrupt and the cell would never end)."""
    import pdb

    from IPython.core import debugger

    if hasattr(debugger, "InterruptiblePdb"):
        debugger.Pdb = debugger.InterruptiblePdb
        pdb.Pdb = debugger.InterruptiblePdb
        pdb.set_trace = debugger.set_trace


def _file_loaders() -> list:
    """What the standard path finder loads from a directory (importlib's own order)."""
    machinery = importlib.machinery
    return [(machinery.ExtensionFileLoader, machinery.EXTENSION_SUFFIXES),
            (machinery.SourceFileLoader, machinery.SOURCE_SUFFIXES),
            (machinery.SourcelessFileLoader, machinery.BYTECODE_SUFFIXES)]


def _use_workspace_packages() -> None:
    """`%pip install` and `!pip install` write to PACKAGES_PREFIX on the sandbox's own disk
    (the Python environment may be read-only, as the local engine's is), and what is there
    is importable: by this runner, by its subprocesses, and after a restart (a new runner
    sets this up again; the files stay). pip follows PIP_PREFIX like its --prefix option."""
    import site
    import sysconfig

    prefix = os.path.expanduser(PACKAGES_PREFIX)
    scheme = {"base": prefix, "platbase": prefix}
    site_dirs = []
    for kind in ("purelib", "platlib"):
        path = sysconfig.get_path(kind, "posix_prefix", vars=scheme)
        if path not in site_dirs:
            site_dirs.append(path)
    os.environ.setdefault("PIP_PREFIX", prefix)
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(site_dirs + inherited)
    os.environ["PATH"] = os.path.join(prefix, "bin") + os.pathsep + os.environ.get("PATH", "")
    # Ahead of the environment's own site-packages, so an installed version wins; .pth
    # files in them are processed as in any site dir.
    first_site = next((i for i, p in enumerate(sys.path) if p.endswith(("site-packages", "dist-packages"))),
                      len(sys.path))
    sys.path[first_site:first_site] = [p for p in site_dirs if p not in sys.path]
    for path in site_dirs:
        if os.path.isdir(path):
            site.addsitedir(path)
        else:
            # Not created until pip installs something (the sandbox starts empty). Python
            # would remember a missing directory as "no finder" and never look again; a
            # finder of its own notices when the directory appears.
            sys.path_importer_cache[path] = importlib.machinery.FileFinder(path, *_file_loaders())


# ----------------------------------------------------------------- daemon


class Channel:
    """One relay's connection (``runner_client.py channel``): many requests, tagged events.

    The kernel keeps one for its lifetime. Each line it sends is a request: ``run`` (a
    cell, followed to its ``done`` event; sent again with ``after`` when a relay had to be
    replaced mid-cell, it only follows the cell from there) or a one-shot op, answered
    with ``{"reply": id, ...}`` when it carries an ``id``. Every event line names its
    cell (``"cell": id``, or null for between-cell output: see BackgroundLog). Interrupt
    and input answers are handled at once, never behind a completion.
    """

    def __init__(self, daemon: "Daemon", connection: socket.socket) -> None:
        self._daemon = daemon
        self._connection = connection
        self._send_lock = threading.Lock()
        self._idle_followers: list[queue.SimpleQueue] = []  # each a waiting follower's inbox
        self._followers_lock = threading.Lock()
        self.open = True

    def serve(self, reader, request: dict) -> None:
        background = self._daemon.router.background()
        after = request.get(protocol.BACKGROUND_AFTER)  # absent: from now on
        self._spawn(self._follow_background, background, after if _is_int_at_least(after, 0) else background.newest)
        self._spawn(self._follower, None)  # waiting before the first cell comes
        try:
            for line in reader:
                if line.strip():
                    self._dispatch(line)
        finally:
            self.open = False

    def _dispatch(self, line: bytes) -> None:
        request: object = None
        try:
            request = json.loads(line)
            if not isinstance(request, dict):
                raise ValueError("the request must be a JSON object")
            op = request.get(protocol.OP)
            if op == protocol.RUN:
                cell = self._daemon._submit(request)
                after = request.get(protocol.AFTER)
                self._follow(cell, after if _is_int_at_least(after, 0) else 0)
            elif op in protocol.IMMEDIATE_OPS:
                self._answer(request, self._daemon._one_shot(op, request))
                if op == protocol.SHUTDOWN:
                    self._daemon._exit()
            else:
                self._spawn(self._answer_later, request)
        except Exception as exc:  # a bad request: say why, to whoever asked
            failure = {protocol.ERROR: "%s: %s" % (type(exc).__name__, exc)}
            if isinstance(request, dict):
                failure.update((key, request[key]) for key in (protocol.CELL_ID, protocol.ID)
                               if isinstance(request.get(key), str))
            self._send(_encode_line(failure))

    def _answer_later(self, request: dict) -> None:
        try:
            reply = self._daemon._one_shot(request.get(protocol.OP), request)
        except Exception as exc:
            reply = {protocol.ERROR: "%s: %s" % (type(exc).__name__, exc)}
        self._answer(request, reply)

    def _answer(self, request: dict, reply: dict) -> None:
        if isinstance(request.get(protocol.ID), str):
            self._send(_encode_line(dict(reply, **{protocol.REPLY: request[protocol.ID]})))

    def _follow(self, cell: Cell, after: int) -> None:
        """Send the cell's events after `after` from a waiting follower thread, or a new one."""
        with self._followers_lock:
            inbox = self._idle_followers.pop() if self._idle_followers else None
        if inbox is None:
            self._spawn(self._follower, (cell, after))
        else:
            inbox.put((cell, after))

    def _follower(self, job: "tuple[Cell, int] | None") -> None:
        """Follow the cells handed to this thread, one after another, while the channel is
        open; wait for the next unless IDLE_FOLLOWERS are waiting already."""
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        while True:
            if job is not None:
                self._follow_cell(*job)
            with self._followers_lock:
                if not self.open or len(self._idle_followers) >= IDLE_FOLLOWERS:
                    return
                self._idle_followers.append(inbox)
            job = self._next_job(inbox)
            if job is None:
                return

    def _next_job(self, inbox: queue.SimpleQueue) -> "tuple[Cell, int] | None":
        while self.open:
            try:
                return inbox.get(timeout=BACKGROUND_POLL)
            except queue.Empty:
                pass
        with self._followers_lock:  # closed: nothing is handed to it any more
            if inbox in self._idle_followers:
                self._idle_followers.remove(inbox)
        return None

    def _follow_cell(self, cell: Cell, after: int) -> None:
        tag = ('{"%s": "%s", ' % (protocol.CELL, cell.cell_id)).encode("ascii")  # ids are checked: [A-Za-z0-9._-]
        while self.open:
            lines, finished = cell.read_after(after, time.monotonic() + BACKGROUND_POLL)
            if lines:
                # Each line with the tag in place of its "{": views, so the lines (up to
                # a MiB each) are copied once, into the joined bytes, not twice more.
                self._send(b"".join(part for line in lines for part in (tag, memoryview(line)[1:])))
                after += len(lines)
            if finished:
                return

    def _follow_background(self, log: BackgroundLog, after: int) -> None:
        while self.open:
            lines = log.read_after(after, BACKGROUND_POLL)
            if lines:
                self._send(b"".join(line for _, line in lines))
                after = lines[-1][0]

    def _send(self, data: bytes) -> None:
        with self._send_lock:
            if not self.open:
                return
            try:
                self._connection.sendall(data)
            except OSError:
                self.open = False

    @staticmethod
    def _spawn(target, *args: object) -> None:
        threading.Thread(target=target, args=args, name=target.__name__, daemon=True).start()




class CellQueue:
    """Submitted cells, run one at a time, in order, on the event loop of one thread."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Cell | None] = queue.Queue()
        self._wake: "typing.Callable[[], None] | None" = None  # set once serve() runs

    def put(self, cell: "Cell | None") -> None:
        """Queue a cell (from any thread); None ends serve() once the cells before it ran."""
        self._queue.put(cell)
        wake = self._wake
        if wake is not None:
            wake()

    async def serve(self, execute: "typing.Callable[[Cell], typing.Awaitable[None]]") -> None:
        loop = asyncio.get_running_loop()
        queued = asyncio.Event()
        self._wake = lambda: loop.call_soon_threadsafe(queued.set)
        while True:
            try:
                cell = self._queue.get_nowait()
            except queue.Empty:
                await queued.wait()
                queued.clear()
                continue
            if cell is None:
                return
            await execute(cell)
            await asyncio.sleep(0)  # tasks the cell started take a step before the next cell


class Subshell:
    """A kernel subshell (ipykernel 7): its own thread, where its cells run one at a time
    on its own event loop, concurrently with the main thread's and other subshells'. The
    IPython shell and the user's namespace are shared, as under ipykernel."""

    def __init__(self, subshell_id: str, execute: "typing.Callable[[Cell], typing.Awaitable[None]]") -> None:
        self.subshell_id = subshell_id
        self.cells = CellQueue()
        self._execute = execute
        self.thread = threading.Thread(target=self._serve, name="subshell-" + subshell_id, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self.cells.serve(self._execute))
        finally:
            loop.close()

    def end(self) -> None:
        """After its queued cells (the kernel sends none once it deletes the subshell)."""
        self.cells.put(None)
        self.thread.join()


class Daemon:
    """Holds the user's session: accepts clients on the unix socket in
    background threads and runs queued cells one by one in the main thread
    (required for signal-based KeyboardInterrupt), on an asyncio event loop that
    runs in and between cells, as under ipykernel; a kernel subshell's cells in its
    own thread (Subshell), which an interrupt does not reach, as under ipykernel."""

    def __init__(self, state_dir: str):
        self.set_state_dir(state_dir)
        self._cells: dict[str, Cell] = {}  # in submission order
        self._queue = CellQueue()  # the main shell's
        self._subshells: dict[str, Subshell] = {}
        self._lock = threading.Lock()
        self._running: Cell | None = None
        self._main_thread = threading.get_ident()
        self._loop: asyncio.AbstractEventLoop  # the main thread's (_main_loop)
        self._server: socket.socket | None = None
        self._connections: set = set()  # open client connections (a forked child closes its copies)
        self.registration_path: str | None = None
        self._usage = UsageMeter()
        # Set once the engine, its bridges and the debugger exist: the ready file comes
        # before (serve_forever), and requests wait for this (_serve_connection).
        self._built = threading.Event()
        self._use_ipython = os.environ.get(NO_IPYTHON_ENV) != "1" and _importable("IPython")
        # Hashed at start, before any other kernel can upload a newer bundle over these files:
        # the kernel tells from it whether this runner is of its own version.
        self.bundle = runner_bundle.own_hash()

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
        _use_workspace_packages()
        sys.stdout = _make_cell_stream(self.router, "stdout", 1)
        sys.stderr = _make_cell_stream(self.router, "stderr", 2)
        # SIGINT is ignored between cells and a KeyboardInterrupt during them.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, lambda signum, frame: self._exit())
        # Ready before IPython starts, the longest part of this start: the kernel's own
        # last steps (its channel to us, the frontend's kernel_info) overlap it, and its
        # requests wait for it here.
        self._start_serving()
        _import_loop_modules()
        _look_in_working_directory_first()
        self.engine = self._create_engine()
        self.inputs = InputBridge(self.router)
        self.inputs.install()
        self.comms = CommBridge(self.router, self.parents)
        # Made before requests are served: one may schedule work on it (_submit) before it runs.
        self._loop = asyncio.new_event_loop()
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
        self._loop_files = _event_loop_files()
        loop = self._loop
        asyncio.set_event_loop(loop)
        cells = loop.create_task(self._queue.serve(self._execute))
        while True:
            try:
                loop.run_until_complete(cells)
            except KeyboardInterrupt:
                # Landed in a task of the user's while an async cell awaited: that task
                # ends with it; the loop and the cell go on.
                if cells.done():
                    cells = loop.create_task(self._queue.serve(self._execute))

    def _create_engine(self):
        inline = self._use_ipython and _importable("matplotlib_inline")
        # Must be set before user code imports matplotlib.
        os.environ["MPLBACKEND"] = "module://matplotlib_inline.backend_inline" if inline else "Agg"
        if self._use_ipython:
            try:
                return IPythonEngine(self.router, self.parents)
            except Exception:
                self.router.log("IPython failed to start, using the plain engine:\n" + traceback.format_exc())
                os.environ["MPLBACKEND"] = "Agg"
        return PlainEngine(self.router)

    def _create_debugger(self) -> "runner_debug.Debugger | None":
        try:
            return _debugger_for(self)
        except Exception:
            self.router.log("the debugger is not available:\n" + traceback.format_exc())
            return None

    def _info(self) -> dict:
        """The info op's answer; the ready file's, written while IPython starts, has no
        ipython_version and tells what the engine will have: the debugger, and subshells
        (threads that run cells with IPython's run_cell, as ipykernel's do). An IPython
        that then fails to start, leaving the plain engine, is the one case where it is wrong."""
        info = {"pid": os.getpid(), "python_version": platform.python_version(),
                "implementation": platform.python_implementation(), runner_bundle.INFO_FIELD: self.bundle}
        if not self._built.is_set():
            return dict(info, debugger=self._use_ipython and runner_debug.debugpy_importable(),
                        subshells=self._use_ipython)
        return dict(info, ipython_version=self.engine.ipython_version, debugger=self.debugger is not None,
                    subshells=isinstance(self.engine, IPythonEngine))

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
        _write_json_atomically(self.ready_path, self._info())

    def _register(self) -> None:
        """Tell the local engine's agent that this process can fork along with its sandbox."""
        directory = os.environ.get(FORKABLE_DIR_ENV)
        if not directory:
            return
        path = os.path.join(directory, "%d.json" % os.getpid())
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
            _write_json_atomically(path, {"pid": os.getpid(), "socket": self.socket_path})
        except OSError as exc:
            self.router.log("could not register in %s=%s: %s\n" % (FORKABLE_DIR_ENV, directory, exc))
            return
        self.registration_path = path

    def _exit(self) -> None:
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
            cell.emit("done", status="ok" if ok else "error", execution_count=count, **reply)
            cell.code = ""  # its events have what matters now

    async def _run_user_code(self, cell: Cell, stored: bool, count: int) -> bool:
        self._start_running(cell)
        try:
            if self.debugger is not None:
                self.debugger.before_cell()
            return await self.engine.run(cell.code, cell.silent, stored, count)
        except KeyboardInterrupt:  # landed in engine code rather than in the user's
            self.router.emit("error", ename="KeyboardInterrupt", evalue="", traceback=[])
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
        (Daemon._submit schedules it there): at once between cells, and while a cell awaits
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
            if during_cell and CellTask.current is not None:
                CellTask.current.cancel()  # the interrupt was meant for the awaiting cell
        except Exception:
            self.router.log("internal error delivering %s:\n%s" % (cell.cell_id, traceback.format_exc()))
        finally:
            self.parents.leave(parent)
            if not during_cell:
                self._stop_running()
                self.router.end(cell)
            cell.emit("done", status="ok")
            cell.code = ""

    def _on_interrupt(self, signum: int, frame) -> None:
        """SIGINT during a cell: a KeyboardInterrupt where the cell's code runs; but a cell
        awaiting (the loop idle in its selector) is cancelled instead, as under ipykernel,
        since the exception would end the loop rather than the cell."""
        task = CellTask.current
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
            try:
                with connection.makefile("rb") as reader:
                    request = json.loads(reader.readline())
                    if not isinstance(request, dict):
                        raise ValueError("the request must be a JSON object")
                    op = request.get(protocol.OP)
                    if op == protocol.CHANNEL:
                        Channel(self, connection).serve(reader, request)
                        return
                if op == protocol.RUN:
                    self._stream(connection, request)
                    return
                connection.sendall(_encode_line(self._one_shot(op, request)))
                if op == protocol.SHUTDOWN:
                    connection.close()
                    self._exit()
            except OSError:
                pass  # the client went away; its next run with `after` resumes
            except Exception as exc:  # a bad request: tell the client why
                try:
                    connection.sendall(_encode_line({"error": "%s: %s" % (type(exc).__name__, exc)}))
                except OSError:
                    pass

    def _stream(self, connection: socket.socket, request: dict) -> None:
        """Send a cell's events with seq > after, until done or ``wait`` seconds."""
        after = int(request.get("after") or 0)
        # "wait": return after that many seconds even if the cell is not done (polling
        # clients, when the sandbox service cannot stream an exec's output).
        wait = request.get("wait")
        cell = self._submit(request)
        deadline = None if wait is None else time.monotonic() + float(wait)
        while True:
            lines, finished = cell.read_after(after, deadline)
            if lines:
                connection.sendall(b"".join(lines))
                after += len(lines)
            if finished or (deadline is not None and time.monotonic() >= deadline):
                return

    def _submit(self, request: dict) -> Cell:
        """Queue a cell, unless that cell_id is known already (then just return it)."""
        cell_id = _checked_cell_id(request.get("cell_id"))
        with self._lock:
            cell = self._cells.get(cell_id)
            if cell is None:
                comm_message = _comm_message(request.get("comm"))  # checked before anything is made
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

    def _subshell_of(self, request: dict) -> Subshell | None:
        """The subshell a run names (None: the main shell); the caller holds self._lock. One
        this runner does not know was made before it started (the last one died, or this is
        a fork): its thread starts now. (The kernel sends only ids of subshells it has.)"""
        subshell_id = request.get(protocol.SUBSHELL_ID)
        if subshell_id is None:
            return None
        return self._subshells.get(subshell_id) or self._start_subshell(subshell_id)

    def _start_subshell(self, subshell_id: object) -> Subshell:
        """The caller holds self._lock."""
        if not isinstance(subshell_id, str) or not subshell_id:
            raise ValueError("a subshell_id must be a non-empty string")
        if not isinstance(self.engine, IPythonEngine):
            raise ValueError("subshells need IPython in the sandbox")
        subshell = self._subshells[subshell_id] = Subshell(subshell_id, self._execute)
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

    def _one_shot(self, op: object, request: dict) -> dict:
        if op == protocol.INTERRUPT:
            return {"ok": True, "running": self._interrupt()}
        if op == protocol.INPUT:
            value = None if request.get("eof") else str(request.get("value", ""))
            return {"ok": self.inputs.answer(str(request.get(protocol.CELL_ID)), value)}
        if op == protocol.COMPLETE:
            return self.engine.complete(request["code"], int(request["cursor_pos"]))
        if op == protocol.INSPECT:
            return self.engine.inspect(request["code"], int(request["cursor_pos"]),
                                       int(request.get("detail_level") or 0))
        if op == protocol.INFO:
            return dict(self._info(), execution_count=self.engine.execution_count)
        if op == protocol.SHUTDOWN:
            return {"ok": True}
        if op == protocol.USAGE:
            return self._usage.sample()
        if op == protocol.COMM_INFO:
            return {"comms": self.comms.info(request.get("target_name"))}
        if op == protocol.DEBUG:
            if self.debugger is None:
                raise ValueError("no debugger in this sandbox (it needs IPython and debugpy)")
            return {"response": self.debugger.handle(request.get("request"))}
        if op == protocol.SUBSHELL:
            return self._subshell_request(request)
        if op == protocol.FORK:
            return runner_fork.fork(self, request)
        raise ValueError("unknown op %r" % (op,))

    def _interrupt(self) -> str | None:
        if self.debugger is not None:
            self.debugger.interrupting()
        with self._lock:
            running = self._running
            if running is not None:
                # Delivered to the main thread so blocking calls (sleep, input) wake up too.
                signal.pthread_kill(self._main_thread, signal.SIGINT)
        return running.cell_id if running is not None else None

    # --- fork (runner_fork.py drives it; these are what it asks of the daemon)

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
        self._queue = CellQueue()
        self._subshells = {}  # their threads stayed in the parent (their cells were ended above)
        self._loop = asyncio.new_event_loop()  # the parent's loop holds the parent's tasks
        self._lock = threading.Lock()
        self._running = None
        self.inputs.reset_after_fork()
        self.engine.reset_after_fork()

        self.router.start_threads()
        self._start_serving()

    def serve_cells(self) -> None:
        self._main_loop()

    def log(self, text: str) -> None:
        self.router.log(text)


# --------------------------------------------------------------- debugger


def _debugger_for(daemon: "Daemon") -> "runner_debug.Debugger | None":
    """The debugger (runner_debug.py), where debugpy is importable and cells run in IPython."""
    if not isinstance(daemon.engine, IPythonEngine) or not runner_debug.debugpy_importable():
        return None
    runner_dir = os.path.dirname(os.path.abspath(__file__))
    # DAP events go out as between-cell events ("cell": null) to the channels. (The
    # between-cell log is made on first use: until a channel asks, such output goes to the log.)
    return runner_debug.Debugger(lambda work: _on_main_thread(daemon, work),
                                 lambda message: daemon.router.background().emit(protocol.DEBUG_EVENT,
                                                                                 content=message),
                                 daemon.engine.shell, [runner_dir], os.path.join(daemon.state_dir, "debugpy.log"))


def _on_main_thread(daemon: "Daemon", work) -> "concurrent.futures.Future":
    """Run work on the daemon's main thread, on its event loop (so between cells); its future."""
    result: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            result.set_result(work())
        except BaseException as exc:
            result.set_exception(exc)

    daemon._loop.call_soon_threadsafe(run)
    return result


class UsageMeter:
    """CPU and memory of this daemon (with its children) and of the whole sandbox, for
    the kernel's usage_reply, read from /proc. CPU is a percentage since the previous
    sample (0 for the first, as psutil's cpu_percent)."""

    def __init__(self) -> None:
        self._last: tuple[float, float, int, int] | None = None  # time, our cpu s, busy and all ticks
        self._lock = threading.Lock()

    def sample(self) -> dict:
        ticks, page = os.sysconf("SC_CLK_TCK"), os.sysconf("SC_PAGE_SIZE")
        processes = _processes()
        ours = _descendants(os.getpid(), processes)
        cpu_seconds = sum(processes[pid][1] for pid in ours) / ticks
        busy, total = _cpu_ticks()
        now = time.monotonic()
        usage = {
            "hostname": socket.gethostname(), "pid": os.getpid(),
            "cpu_count": len(os.sched_getaffinity(0)),
            "kernel_memory": sum(processes[pid][2] for pid in ours) * page,
            "sandbox_processes_memory": sum(rss for _, _, rss in processes.values()) * page,
            "meminfo": _meminfo(),
        }
        with self._lock:
            last, self._last = self._last, (now, cpu_seconds, busy, total)
        usage["kernel_cpu"] = 0.0
        if last is not None and now > last[0]:
            usage["kernel_cpu"] = round(100.0 * max(cpu_seconds - last[1], 0.0) / (now - last[0]), 1)
            if total > last[3]:
                usage["host_cpu_percent"] = round(100.0 * (busy - last[2]) / (total - last[3]), 1)
        return usage


def _processes() -> dict:
    """pid: (parent pid, cpu ticks used, resident pages) of every process this sandbox shows."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name) as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        # After the command: state, ppid, ... utime (12th), stime (13th), ... rss (22nd).
        found[int(name)] = (int(fields[1]), int(fields[11]) + int(fields[12]), int(fields[21]))
    return found


def _descendants(root: int, processes: dict) -> list:
    children: dict = {}
    for pid, (parent, _, _) in processes.items():
        children.setdefault(parent, []).append(pid)
    tree, pending = [], [root]
    while pending:
        pid = pending.pop()
        if pid in processes:
            tree.append(pid)
            pending.extend(children.get(pid, []))
    return tree


def _cpu_ticks() -> tuple[int, int]:
    """(busy, all) CPU ticks of the machine so far, from /proc/stat."""
    with open("/proc/stat") as stat:
        values = [int(value) for value in stat.readline().split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle and iowait
    return sum(values) - idle, sum(values)


def _meminfo() -> dict:
    """MemTotal, MemAvailable, MemFree, Active and Inactive in bytes."""
    wanted = {"MemTotal": "total", "MemAvailable": "available", "MemFree": "free",
              "Active": "active", "Inactive": "inactive"}
    found = {}
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            key, _, rest = line.partition(":")
            if key in wanted:
                found[wanted[key]] = int(rest.split()[0]) * 1024
    return found


def _close_socket(sock: socket.socket) -> None:
    """Close our fd of a socket whatever its state (a makefile may still refer to it)."""
    try:
        fd = sock.detach()
        if fd >= 0:
            os.close(fd)
    except OSError:
        pass


def _write_json_atomically(path: str, obj: dict) -> None:
    temporary = "%s.%d.tmp" % (path, os.getpid())
    with open(temporary, "w") as output:
        json.dump(obj, output)
    os.replace(temporary, path)


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


def _importable(module_name: str) -> bool:
    return importlib.util.find_spec(module_name) is not None


def _socket_alive(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
