"""A submitted cell and its events, the between-cell output log, and the output budget
each of them shows output within.

Both keep their events as encoded lines (wire.py), numbered by seq, so that a client can
read them again from any seq: a relay replaced mid-cell, the exec-per-cell transport's
reconnect, a channel that starts again.
"""
from __future__ import annotations

import collections
import threading
import time

from .. import protocol
from .wire import encode_line, is_int_at_least

FORK_ERROR_MESSAGE = "this cell was running when the sandbox was forked; it continues only in the original sandbox"
# Output floods (a cell printing without end): each cell may show this much output
# (characters of stream text plus the size of displays), then the rest is dropped with
# one notice. Past a burst of OUTPUT_BURST_SECONDS' worth, writers are slowed to the rate
# (bytes per second; 0: no rate limit), as by a slow terminal. The kernel sends its own
# values with each cell.
DEFAULT_OUTPUT_LIMIT = 64 * 1024 * 1024
DEFAULT_OUTPUT_RATE = 8 * 1024 * 1024
OUTPUT_BURST_SECONDS = 4.0
BACKGROUND_RETAINED = 4 * 1024 * 1024  # bytes of between-cell events kept for a channel


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
            event = {protocol.SEQ: len(self._lines) + 1, protocol.TYPE: type_}
            event.update(fields)
            line = encode_line(event)
            self._lines.append(line)
            if type_ == protocol.DONE:
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
        self.emit(protocol.ERROR_EVENT, ename="ForkError", evalue=FORK_ERROR_MESSAGE, traceback=[])
        done: dict = {"status": "error"}
        if self.started_count is not None:
            done["execution_count"] = self.started_count
        self.emit(protocol.DONE, **done)
        self.code = ""


class BackgroundLog:
    """Output produced while no cell runs (a thread's print, a subprocess), for the
    channels (channel.py) to pass on: the kernel shows it on the last cell's parent.

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
            line = encode_line(event)
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
        return cls(limit if is_int_at_least(limit, 1) else DEFAULT_OUTPUT_LIMIT,
                   rate if is_int_at_least(rate, 0) else DEFAULT_OUTPUT_RATE)

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


def _mebibytes(size: int) -> str:
    return "%g MiB" % round(size / (1024 * 1024), 2)
