"""A loopback TCP proxy in front of the real engine that breaks streaming exec the ways
CreateOS can: it cuts the first `max_cuts` streams after a number of bytes (later ones
pass, so a run always ends), answers every streaming exec with `stream_reply` (a 404,
or an `error` frame) as services without streaming exec do, or answers the first sandbox
creations with `create_replies` (401, 402, 429, 503...), one each, then lets them through;
`connect_replies` does the same to the first connects to managed processes' output streams.
Armed with `fail_buffered_execs`, it answers chosen buffered (non-streaming) execs with a
502, either before forwarding them or after the engine has run them, as a gateway that
gives up on a long-held request does. With `hold_status` = (real, shown), sandbox views
(and the answers to pause and resume) say `shown` where the engine says `real`, as a
CreateOS transition taking minutes looks.
With `hold_transition(id, shown)`, one sandbox looks stuck in a transition (`pausing`,
`resuming`, `forking`), as a large CreateOS VM is for seconds, until `release()`: its views
say `shown`, and every change asked of it (resume, exec, process input, upload...) is
answered 409, as CreateOS answers a sandbox that is not settled (createos-api.md §4.2).
With `hold_creates`, sandbox creations reach the engine but their answers never come back
(a CreateOS create taking minutes); `held_creates` lists the ids the engine answered.
With `hold_deletes` set, sandbox destructions wait in the proxy until it is unset
(`held_deletes` counts them): a kernel's shutdown is then under way for as long as a test needs.
With `refuse_processes`, creating a managed process is answered with a 404, as by a
provider without them (the kernel then runs one exec per cell). The cuts apply to managed
processes' `connect` streams as to streaming execs.

It sits between a kernel and the real local engine, so the kernel's session meets a
real dropped connection mid-cell (what a CreateOS gateway timeout looks like).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from sandbox_kernel.local.service import EngineEndpoint

# A request answered with one sandbox's view: a GET of it, or a pause or resume (the local
# engine answers those `paused`/`running` once done; CreateOS, whose transitions the
# proxy shows, mostly `pausing`/`resuming`).
VIEW_REQUEST = re.compile(rb"(GET /v1/sandboxes/[^/?\s]+|POST /v1/sandboxes/[^/?\s]+/(pause|resume)) HTTP/1.1$")
# A request about one sandbox: its method, the sandbox's id, and the rest of its path.
SANDBOX_REQUEST = re.compile(rb"([A-Z]+) /v1/sandboxes/([^/?\s]+)(\S*) HTTP/1.1$")
DESTROY_REQUEST = re.compile(rb"DELETE /v1/sandboxes/[^/?\s]+ HTTP/1.1$")
PROCESS_CREATE = re.compile(rb"POST /v1/sandboxes/[^/?\s]+/processes HTTP/1.1$")
CONNECT_REQUEST = re.compile(rb"GET /v1/sandboxes/[^/?\s]+/processes/[^/?\s]+/connect\?")
# In an exec frame's JSON, the end of a line the runner wrote: `\n` after an even run of
# backslashes (a newline within an event's own text is escaped twice: `\\n`).
EVENT_LINE_END = re.compile(rb"(?<!\\)(?:\\\\)*\\n")


def http_reply(status: str, body: dict, *headers: str) -> bytes:
    """A whole JSON response, the connection closed after it: `status` as "429 Too Many Requests"."""
    payload = json.dumps(body).encode()
    head = [f"HTTP/1.1 {status}", "Content-Type: application/json", "Connection: close",
            f"Content-Length: {len(payload)}", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + payload


NOT_FOUND = http_reply("404 Not Found", {"status": "fail", "data": "not found"})
CONFLICT = http_reply("409 Conflict", {"status": "fail", "data": {"message": "sandbox is in transition",
                                                                  "code": "invalid_state"}})
BAD_GATEWAY = http_reply("502 Bad Gateway", {"status": "error", "message": "bad gateway"})
SLOW_DOWN = http_reply("429 Too Many Requests", {"status": "fail", "data": "rate limited"}, "Retry-After: 1")


class FaultProxy:
    def __init__(self, upstream_port: int, cut_after_bytes: int = 0, max_cuts: int = 0,
                 stream_reply: bytes | None = None, create_replies: list[bytes] | None = None,
                 hold_creates: bool = False, refuse_processes: bool = False,
                 connect_replies: list[bytes] | None = None) -> None:
        self.upstream_port = upstream_port
        self.cut_after_bytes = cut_after_bytes
        self.max_cuts = max_cuts
        self.stream_reply = stream_reply
        self.create_replies = list(create_replies or [])
        self.connect_replies = list(connect_replies or [])
        self.refused_connects = 0
        self.creates_seen = 0
        self.hold_creates = hold_creates
        self.refuse_processes = refuse_processes
        self.refused_processes = 0
        self.held_creates: list[str] = []
        self.cuts = 0
        self.refused_streams = 0
        # Buffered execs counted from when fail_buffered_execs() armed the proxy.
        self._exec_faults: dict[int, str] = {}
        self.buffered_execs = 0
        self.bad_gateways = 0
        self.hold_status: tuple[str, str] | None = None
        self.held_views = 0
        self.hold_deletes = False
        self.held_deletes = 0
        self.transition: tuple[str, str] | None = None  # (sandbox id, status shown): hold_transition
        self.refused_in_transition = 0
        self.request_lines: list[bytes] = []  # every request's first line, in order
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        self._ready.wait(10)
        return self

    def fail_buffered_execs(self, faults: dict[int, str]) -> None:
        """From now on, answer the n-th buffered exec (1-based) with a 502, "before" it
        reaches the engine or "after" the engine has run it (its answer is thrown away)."""
        self.buffered_execs = 0
        self._exec_faults = dict(faults)

    def hold_transition(self, sandbox_id: str, shown: str) -> None:
        """From now on, sandbox_id looks `shown` (a transition) and refuses every change."""
        self.held_views = self.refused_in_transition = 0
        self.transition = (sandbox_id, shown)

    def release(self) -> None:
        """The held transition is over: the engine's own state shows through again."""
        self.transition = None

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        upstream_r, upstream_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        # Per request on this (keep-alive) connection: is it a streaming exec (or a process's
        # connect), how many response bytes has it had, has a whole runner event passed?
        state: dict[str, Any] = {"streaming": False, "relayed": 0, "event_passed": False, "tail": b""}

        async def requests() -> None:
            while data := await client_r.read(65536):
                if data[:8].split(b" ")[0] in (b"GET", b"POST", b"PUT", b"DELETE", b"PATCH"):
                    request_line = data.split(b"\r\n")[0]
                    self.request_lines.append(request_line)
                    streams_output = b"stream=true" in request_line or CONNECT_REQUEST.match(request_line)
                    state.update(streaming=bool(streams_output), relayed=0, tail=b"",
                                 event_passed=bool(CONNECT_REQUEST.match(request_line)))
                    reply = None
                    in_transition = self._in_transition(request_line)
                    if in_transition == "view":
                        answer = await self._exchange(await _whole_request(data, client_r))
                        client_w.write(self._shown_in_transition(answer))
                        await client_w.drain()
                        continue
                    if in_transition == "change":
                        await _whole_request(data, client_r)  # read to its end: a reset could beat the answer
                        self.refused_in_transition += 1
                        reply = CONFLICT
                    elif self.hold_deletes and DESTROY_REQUEST.match(request_line):
                        self.held_deletes += 1
                        while self.hold_deletes:  # then sent on, below
                            await asyncio.sleep(0.02)
                    elif self.connect_replies and CONNECT_REQUEST.match(request_line):
                        self.refused_connects += 1
                        reply = self.connect_replies.pop(0)
                    elif self.refuse_processes and PROCESS_CREATE.match(request_line):
                        self.refused_processes += 1
                        reply = NOT_FOUND
                    elif state["streaming"] and self.stream_reply is not None and not CONNECT_REQUEST.match(
                            request_line):
                        self.refused_streams += 1
                        reply = self.stream_reply
                    elif request_line.startswith(b"POST /v1/sandboxes ") and self.hold_creates:
                        self.creates_seen += 1
                        answer = await self._exchange(await _whole_request(data, client_r))
                        self.held_creates.append(json.loads(answer.partition(b"\r\n\r\n")[2])["data"]["id"])
                        while await client_r.read(65536):  # no answer, until the client gives up
                            pass
                        return
                    elif request_line.startswith(b"POST /v1/sandboxes "):
                        self.creates_seen += 1
                        reply = self.create_replies.pop(0) if self.create_replies else None
                    elif self._exec_faults and request_line.endswith(b"/exec HTTP/1.1"):
                        self.buffered_execs += 1
                        fault = self._exec_faults.get(self.buffered_execs)
                        if fault == "after":  # the engine runs it; its answer is lost
                            await self._exchange(await _whole_request(data, client_r))
                        if fault:
                            self.bad_gateways += 1
                            reply = BAD_GATEWAY
                    elif self.hold_status and VIEW_REQUEST.match(request_line):
                        client_w.write(self._held(await self._exchange(await _whole_request(data, client_r))))
                        await client_w.drain()
                        continue
                    if reply is not None:
                        client_w.write(reply)
                        client_w.close()  # flushes the reply before the connection ends
                        await client_w.wait_closed()
                        return
                upstream_w.write(data)
                await upstream_w.drain()

        async def responses() -> None:
            # An exec stream is cut only once a whole event of the runner's has passed: the
            # kernel takes two exec streams in a row that bring none as a provider that
            # cannot stream, and polls (under load the runner batches more lines per event).
            # A process's stream is cut after the bytes alone: its frames are replayed by seq.
            while data := await upstream_r.read(256):
                if state["streaming"] and self.cuts < self.max_cuts:
                    state["relayed"] += len(data)
                    seen = state["tail"] + data
                    state["event_passed"] = state["event_passed"] or bool(EVENT_LINE_END.search(seen))
                    state["tail"] = seen[-16:]
                    if state["relayed"] > self.cut_after_bytes and state["event_passed"]:
                        self.cuts += 1
                        return
                client_w.write(data)
                await client_w.drain()

        tasks = [asyncio.ensure_future(requests()), asyncio.ensure_future(responses())]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            task.cancel()
        for writer in (client_w, upstream_w):
            writer.transport.abort()  # a hard cut, as a failing gateway does

    async def _exchange(self, request: bytes) -> bytes:
        """Send one whole request to the engine on its own connection; its whole answer."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        try:
            writer.write(request)
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            return head + await reader.readexactly(_content_length(head))
        finally:
            writer.transport.abort()

    def _in_transition(self, request_line: bytes) -> str | None:
        """"view" for a view of the sandbox held in transition, "change" for a change asked
        of it (reads of its files and streams pass; a destroy too: CreateOS allows one)."""
        held = self.transition
        match = SANDBOX_REQUEST.match(request_line)
        if held is None or match is None or match.group(2).decode() != held[0]:
            return None
        method, rest = match.group(1), match.group(3)
        if method == b"GET":
            return "view" if not rest else None
        return None if method == b"DELETE" and not rest else "change"

    def _shown_in_transition(self, response: bytes) -> bytes:
        """A view of the held sandbox, with the transition's status in place of the engine's."""
        held = self.transition
        head, _, body = response.partition(b"\r\n\r\n")
        view = json.loads(body)
        if held is not None and isinstance(view.get("data"), dict) and view["data"].get("id") == held[0]:
            view["data"]["status"] = held[1]
            self.held_views += 1
        return _with_body(head, json.dumps(view).encode())

    def _held(self, response: bytes) -> bytes:
        """A sandbox view answer with the held status shown instead of the real one."""
        assert self.hold_status is not None
        real, shown = self.hold_status
        head, _, body = response.partition(b"\r\n\r\n")
        body, count = re.subn(rb'"status": ?"%s"' % real.encode(), b'"status":"%s"' % shown.encode(), body)
        self.held_views += count
        return _with_body(head, body)


def _with_body(head: bytes, body: bytes) -> bytes:
    """An HTTP answer with its body replaced (and its length said again)."""
    head = re.sub(rb"(?i)content-length: *\d+", b"content-length: %d" % len(body), head)
    return head + b"\r\n\r\n" + body


def _content_length(head: bytes) -> int:
    return next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                 if line.lower().startswith(b"content-length:")), 0)


async def _whole_request(data: bytes, reader: asyncio.StreamReader) -> bytes:
    """`data` completed to the end of its body (headers and body may arrive apart)."""
    while b"\r\n\r\n" not in data:
        data += await reader.read(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = _content_length(head)
    if len(body) < length:
        body += await reader.readexactly(length - len(body))
    return head + b"\r\n\r\n" + body



@contextlib.contextmanager
def proxied_engine(engine: EngineEndpoint, monkeypatch: pytest.MonkeyPatch,
                   **faults: Any) -> Iterator[FaultProxy]:
    """A FaultProxy (with `faults`) in front of the engine. Kernels started inside reach
    the engine through it, on the CreateOS code path (base URL and key, as for the cloud)."""
    with FaultProxy(int(engine.url.rsplit(":", 1)[1]), **faults) as proxy:
        monkeypatch.setenv("CREATEOS_SANDBOX_BASE_URL", f"http://127.0.0.1:{proxy.port}")
        monkeypatch.setenv("CREATEOS_SANDBOX_API_KEY", engine.token)
        yield proxy
