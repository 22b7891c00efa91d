"""Where a cell's output goes: the single funnel (OutputRouter) for everything user code,
its threads and its subprocesses write or display, into the running cell's events or, between
cells, the background log; the capture of file descriptors 1 and 2; sys.stdout/stderr
replacements; and which frontend request the output answers (ParentRequests).
"""
from __future__ import annotations

import codecs
import contextvars
import io
import math
import os
import select
import threading
import time

from .. import protocol
from .cells import BackgroundLog, Cell
from .wire import encode_line

# Events that count against a cell's output limit (and are dropped past it); the others
# (results, errors, input requests) are one or few per cell and the kernel needs them.
LIMITED_EVENTS = (protocol.DISPLAY_DATA, protocol.UPDATE_DISPLAY_DATA, protocol.CLEAR_OUTPUT, protocol.COMM)


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
    subshell's cell runs in its own thread (see loop.Subshell): what that thread writes or
    displays goes to that cell; everything else (other threads, subprocesses through the
    captured fds) to the main shell's cell, or between cells to the background log.
    """

    FLUSH_INTERVAL = 0.01
    # ipykernel's flush interval: a partial line shows no later than it would there.
    LINE_WAIT = 0.2
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
        self._flush_due = math.inf  # when the flusher sends text an explicit flush left to it
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
            write_all(1 if name == "stdout" else 2, text.encode("utf-8", "replace"))
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
            size = len(encode_line(fields))
            if sink.budget.take(size) < size:
                self._notice_limit(sink)
                return
            sink.emit(type_, **fields)
            self._pace(sink)

    def log(self, text: str) -> None:
        write_all(self._capture.log_fds["stderr"], text.encode("utf-8", "replace"))

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
            write_all(self._capture.log_fds[name], text.encode("utf-8", "replace"))
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
        # An explicit flush's due time is met, whoever sent the text: left set, the next
        # cell's first write went at once, cut off from the rest of its line.
        self._flush_due = math.inf
        sink, self._pending_sink = self._pending_sink, None
        if sink is None:
            return
        allowed = sink.budget.take(len(text))
        if allowed:
            sink.emit(protocol.STREAM, name=self._pending_name, text=text if allowed == len(text) else text[:allowed],
                      **self._parent_field(sink, self._pending_parent))
        if allowed < len(text):
            self._notice_limit(sink)
        self._pace(sink)

    @staticmethod
    def _notice_limit(sink: "Cell | BackgroundLog") -> None:
        """Tell the cell, once, that its output is being dropped from now on."""
        if not sink.limit_noticed:
            sink.limit_noticed = True
            sink.emit(protocol.STREAM, name="stderr", text=sink.budget.notice())

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
        thread sends it when that interval ends, so a loop that flushes every line is still
        at most one event per interval."""
        with self._lock:
            if not self._pending:
                return
            if time.monotonic() - self._last_flush >= self.FLUSH_INTERVAL:
                self._flush()
                self._last_flush = time.monotonic()
            else:
                # At the interval's end, not a whole interval after the text came: a print
                # loop's line that came a little early waited out 10 ms more.
                self._flush_due = self._last_flush + self.FLUSH_INTERVAL
                self._has_pending.notify()

    def _flush_forever(self) -> None:
        # Unflushed text waits out the interval: a tight print loop is one event per interval,
        # and the prints of a quick cell are one output, as ipykernel's batching makes them
        # (a saved notebook's outputs do not depend on which kernel ran it).
        with self._has_pending:
            while True:
                while not self._pending:
                    self._has_pending.wait()
                started = time.monotonic()
                while self._pending:
                    wait = self._sending_time(started) - time.monotonic()
                    if wait <= 0:
                        break
                    # A line being finished is looked at every interval: its end does not notify.
                    self._has_pending.wait(min(wait, self.FLUSH_INTERVAL))
                self._flush_round()

    def _sending_time(self, started: float) -> float:
        """When the flusher sends text pending since ``started`` (the lock held): at the
        interval's end, or sooner if an explicit flush asked. Text that ends mid-line waits
        for its line up to LINE_WAIT: ``print(x)`` is two writes, and a busy machine can stall
        the cell between them long enough to cut its line into two outputs."""
        due = min(started + self.FLUSH_INTERVAL, self._flush_due)
        if self._flush_due == math.inf and not self._pending[-1].endswith(("\n", "\r")):
            return max(due, started + self.LINE_WAIT)
        return due

    def _flush_round(self) -> None:
        """The end of a flusher's wait (the lock held): the pending text, unless an explicit
        flush sent it meanwhile. Only an event sent starts a new interval: an empty round that
        did held the next line of a print loop 10 ms."""
        if self._pending:
            self._flush()
            self._last_flush = time.monotonic()
        self._flush_due = math.inf

    def _read_fds_forever(self) -> None:
        while True:
            self._capture.wait_readable()
            with self._lock:
                self._absorb_fd_output()


def write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def make_cell_stream(router: OutputRouter, name: str, fd: int) -> io.TextIOBase:
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

    # ipykernel's shell API (the IPython shell delegates to these; see ipython.py)

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
