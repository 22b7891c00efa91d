"""One relay's connection to the daemon (``client.py channel``): many requests, tagged events.
"""
from __future__ import annotations

import json
import queue
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


class Channel:
    """One relay's connection: many requests, tagged events.

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
        self._spawn(self._follow_background, background, after if is_int_at_least(after, 0) else background.newest)
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
