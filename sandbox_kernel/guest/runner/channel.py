"""The kernel's channel, served by the daemon itself on the relay's pipes.

The relay (``client.py channel``) is the managed process the kernel talks through: the
service's handle on the channel. It connects to the daemon, hands over its stdin and
stdout (SCM_RIGHTS) and becomes a bare ``cat`` of that connection, which ends when the
daemon closes it (or dies). From then on the daemon reads the kernel's request lines from
that stdin and writes the channel's events to that stdout: no copy through a second
process on the way (one hop and one Python less per sandbox). The relay's end of the
connection going away (it was killed) ends the channel here too.

Stdout is flow-controlled: at most protocol.CHANNEL_WINDOW bytes are written ahead of the kernel's
acknowledgements (stdin lines `{"ack": BYTES}`, the stdout bytes it has received), so the
service's retained output window, which a slow reader would fall out of, always holds
what the kernel has not read yet.
"""
from __future__ import annotations

import json
import os
import queue
import select
import socket
import threading
import time
import typing

from .. import protocol
from .cells import BackgroundLog, Cell
from .wire import encode_line, is_int_at_least

if typing.TYPE_CHECKING:
    from .daemon import Daemon

BACKGROUND_POLL = 1.0  # seconds a channel's idle threads wait before checking it is still open
# Threads a channel keeps waiting to follow the next cell. Starting a thread per cell took
# 0.6-0.8 ms of the relay's thread, holding the GIL just as the cell's own thread woke to
# run it (timestamps at each hop); handing a cell to a waiting thread is a queue put.
IDLE_FOLLOWERS = 2
ACK_PREFIX = b'{"ack": '
READ_CHUNK = 1 << 16


class Credit:
    """How many more bytes the channel may write before the kernel acknowledges some."""

    def __init__(self) -> None:
        self.written = 0
        self.acked = 0
        self._gate = threading.Semaphore(0)  # released by each acknowledgement, to wake a waiting writer

    def wait(self, still_open: typing.Callable[[], bool]) -> int:
        """Bytes that may be written now (> 0), waiting for an acknowledgement if none;
        0 once the channel is closed."""
        while still_open():
            room = protocol.CHANNEL_WINDOW - (self.written - self.acked)
            if room > 0:
                return room
            self._gate.acquire(timeout=0.5)
        return 0

    def ack(self, received: int) -> None:
        self.acked = max(self.acked, min(received, self.written))
        self._gate.release()


class Channel:
    """One relay's channel: many requests, tagged events.

    The kernel keeps one for its lifetime. Each line it sends is a request: ``run`` (a
    cell, followed to its ``done`` event; sent again with ``after`` when a relay had to be
    replaced mid-cell, it only follows the cell from there) or a one-shot op, answered
    with ``{"reply": id, ...}`` when it carries an ``id``. Every event line names its
    cell (``"cell": id``, or null for between-cell output: see BackgroundLog). Interrupt
    and input answers are handled at once, never behind a completion.
    """

    def __init__(self, daemon: "Daemon", connection: socket.socket, requests_fd: int, events_fd: int) -> None:
        self._daemon = daemon
        self._connection = connection  # the relay's end going away ends the channel
        self._requests_fd = requests_fd  # the relay's stdin: the kernel's request lines
        self._events_fd = events_fd  # the relay's stdout: what the kernel reads
        self._credit = Credit()
        self._send_lock = threading.Lock()
        self._idle_followers: list[queue.SimpleQueue] = []  # each a waiting follower's inbox
        self._followers_lock = threading.Lock()
        self.open = True

    def serve(self, request: dict) -> None:
        """Tell the relay its pipes are taken, then serve the channel until the kernel or the
        relay is done with it; the pipes are closed on return, whatever happened (the
        daemon's connection too, by the caller)."""
        try:
            self._connection.sendall(encode_line({protocol.CHANNEL: protocol.CHANNEL_TAKEN}))
            background = self._daemon.router.background()
            after = request.get(protocol.BACKGROUND_AFTER)  # absent: from now on
            self._spawn(self._follow_background, background,
                        after if is_int_at_least(after, 0) else background.newest)
            self._spawn(self._follower, None)  # waiting before the first cell comes
            self._read_requests()
        finally:
            self.open = False
            os.close(self._requests_fd)
            with self._send_lock:  # no writer is between its check and its write
                os.close(self._events_fd)

    def abandon(self) -> None:
        """Fork child: these pipes are the parent's channel's; close our copies, no lock taken."""
        self.open = False
        for fd in (self._requests_fd, self._events_fd):
            try:
                os.close(fd)
            except OSError:
                pass

    def _read_requests(self) -> None:
        """Request lines from the relay's stdin until its end; acknowledgements go to the
        credit. Ends as well when the relay's connection closes (it was killed)."""
        poller = select.poll()
        poller.register(self._requests_fd, select.POLLIN)
        poller.register(self._connection.fileno(), select.POLLIN)
        pending = b""
        while True:
            if any(fd != self._requests_fd for fd, _ in poller.poll()):
                return  # the relay never writes to us: readable means it is gone
            chunk = os.read(self._requests_fd, READ_CHUNK)
            if not chunk:
                return  # the kernel is done with this channel
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                if line.startswith(ACK_PREFIX):
                    digits = line[len(ACK_PREFIX):].rstrip(b"} \r")
                    if digits.isdigit():
                        self._credit.ack(int(digits))
                elif line.strip():
                    self._dispatch(line)

    def _dispatch(self, line: bytes) -> None:
        request: object = None
        try:
            request = json.loads(line)
            if not isinstance(request, dict):
                raise ValueError("the request must be a JSON object")
            op = request.get(protocol.OP)
            if op == protocol.RUN:
                cell = self._daemon.submit(request)
                after = request.get(protocol.AFTER)
                self._follow(cell, after if is_int_at_least(after, 0) else 0)
            elif op in protocol.IMMEDIATE_OPS:
                self._answer(request, self._daemon.answer(request))
                if op == protocol.SHUTDOWN:
                    self._daemon.exit()
            else:
                self._spawn(self._answer_later, request)
        except Exception as exc:  # a bad request: say why, to whoever asked
            failure = {protocol.ERROR: "%s: %s" % (type(exc).__name__, exc)}
            if isinstance(request, dict):
                failure.update((key, request[key]) for key in (protocol.CELL_ID, protocol.ID)
                               if isinstance(request.get(key), str))
            self._send(encode_line(failure))

    def _answer_later(self, request: dict) -> None:
        try:
            reply = self._daemon.answer(request)
        except Exception as exc:
            reply = {protocol.ERROR: "%s: %s" % (type(exc).__name__, exc)}
        self._answer(request, reply)

    def _answer(self, request: dict, reply: dict) -> None:
        if isinstance(request.get(protocol.ID), str):
            self._send(encode_line(dict(reply, **{protocol.REPLY: request[protocol.ID]})))

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
        """Write `data` to the kernel, within the credit its acknowledgements give."""
        view = memoryview(data)
        with self._send_lock:
            try:
                while view and self.open:
                    room = self._credit.wait(lambda: self.open)
                    written = os.write(self._events_fd, view[:room])
                    self._credit.written += written
                    view = view[written:]
            except OSError:
                self.open = False

    @staticmethod
    def _spawn(target, *args: object) -> None:
        threading.Thread(target=target, args=args, name=target.__name__, daemon=True).start()
