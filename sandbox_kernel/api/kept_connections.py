"""Small API calls over kept-alive HTTP/1.1 connections of our own.

Every cell, output acknowledgement and comm message is one ``POST .../processes/:pid/input``
with a body of a few hundred bytes and an answer of a few dozen. Through httpx's client and
httpcore's pool such a call cost the kernel 3.7 ms of CPU on the 2-core machine this was
measured on (URL and header models, the pool, h11's state machine, anyio's streams, each a
layer of coroutines), on every cell's path before the sandbox has its code; written and read
directly over a kept connection, 0.3 ms. This transport does only that much HTTP: a request
whose body is given whole, an answer framed by Content-Length, chunked encoding or the
connection's end, no compression (none is asked for), no redirects, no proxy (the client
does not use it where one would apply). Failures are httpx's exceptions, the ones httpcore
raises in the same cases, so callers (the client's error mapping, the local engine's
restarting transport) treat them as from any transport.
"""

from __future__ import annotations

import asyncio
import select
import ssl
from collections.abc import Callable

import httpx

# Header block and body limits: the answers this carries are a few hundred bytes (a JSend
# envelope, or an error with its message); anything far larger is not an API answer.
MAX_HEAD = 64 * 1024
MAX_BODY = 1 << 20
# Idle connections kept for the next call; calls made at the same time (an acknowledgement
# while a cell is being sent) open more, which are closed after use beyond this many.
KEEP_IDLE = 2


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, tls: bool) -> None:
        self.reader = reader
        self.writer = writer
        self.tls = tls

    def is_stale(self) -> bool:
        """An idle connection the server closed (or wrote to unasked) is not reused: a
        request written to it could be lost, and a POST is not sent twice."""
        if self.reader.at_eof() or self.writer.is_closing():
            return True
        if self.tls:  # a TLS server may send session tickets unasked: the socket's state says nothing
            return False
        # What the event loop has not handled yet: the server's close, just now.
        sock = self.writer.get_extra_info("socket")
        return sock is None or bool(select.select([sock], [], [], 0)[0])

    def close(self) -> None:
        self.writer.close()


class KeptConnections(httpx.AsyncBaseTransport):
    """Requests to one server (a unix socket, or host and port, with TLS when `tls` gives
    its context) over kept-alive connections, one request per connection at a time."""

    def __init__(self, *, uds: str | None = None, host: str = "", port: int = 0,
                 tls: Callable[[], ssl.SSLContext] | None = None) -> None:
        self._uds = uds
        self._host = host
        self._port = port
        self._tls = tls  # called once, at the first connection: loading CA certificates costs
        self._tls_context: ssl.SSLContext | None = None
        self._idle: list[_Connection] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeouts = request.extensions.get("timeout", {})
        connection = await self._take(timeouts.get("connect"))
        try:
            await self._write(connection, request, timeouts.get("write"))
            status, headers, body, keep = await _with_timeout(
                _read_answer(connection.reader), timeouts.get("read"), httpx.ReadTimeout)
        except BaseException:  # its state is unknown (cancelled mid-answer, say): never reused
            connection.close()
            raise
        if keep and len(self._idle) < KEEP_IDLE:
            self._idle.append(connection)
        else:
            connection.close()
        return httpx.Response(status, headers=headers, content=body, request=request)

    async def aclose(self) -> None:
        while self._idle:
            self._idle.pop().close()

    async def _take(self, timeout: float | None) -> _Connection:
        while self._idle:
            connection = self._idle.pop()
            if not connection.is_stale():
                return connection
            connection.close()
        return await _with_timeout(self._open(), timeout, httpx.ConnectTimeout)

    async def _open(self) -> _Connection:
        try:
            if self._uds is not None:
                reader, writer = await asyncio.open_unix_connection(self._uds, limit=MAX_HEAD)
            else:
                if self._tls is not None and self._tls_context is None:
                    self._tls_context = self._tls()
                reader, writer = await asyncio.open_connection(
                    self._host, self._port, limit=MAX_HEAD, ssl=self._tls_context,
                    server_hostname=self._host if self._tls_context is not None else None)
        except (OSError, ssl.SSLError) as exc:
            raise httpx.ConnectError(str(exc) or type(exc).__name__) from None
        return _Connection(reader, writer, self._tls_context is not None)

    @staticmethod
    async def _write(connection: _Connection, request: httpx.Request, timeout: float | None) -> None:
        target = request.url.raw_path
        head = b"".join((request.method.encode("ascii"), b" ", target, b" HTTP/1.1\r\n",
                         *(b"%s: %s\r\n" % pair for pair in request.headers.raw), b"\r\n"))
        try:
            connection.writer.write(head + request.content)
            await _with_timeout(connection.writer.drain(), timeout, httpx.WriteTimeout)
        except OSError as exc:
            raise httpx.WriteError(str(exc) or type(exc).__name__) from None


async def _with_timeout(awaitable, timeout: float | None, error: type[httpx.TimeoutException]):  # type: ignore[no-untyped-def]
    try:
        async with asyncio.timeout(timeout):
            return await awaitable
    except TimeoutError:
        raise error("timed out") from None


async def _read_answer(reader: asyncio.StreamReader) -> tuple[int, list[tuple[bytes, bytes]], bytes, bool]:
    """(status, headers, body, whether the connection may be reused)."""
    try:
        while True:
            version, status, headers = _parse_head(await reader.readuntil(b"\r\n\r\n"))
            if not 100 <= status < 200:  # an interim answer (100 Continue) precedes the real one
                break
        fields = {name.lower(): value for name, value in headers}
        connection = fields.get(b"connection", b"").lower()
        keep = b"keep-alive" in connection if version == b"HTTP/1.0" else b"close" not in connection
        if b"chunked" in fields.get(b"transfer-encoding", b"").lower():
            body = await _read_chunked(reader)
        elif b"content-length" in fields:
            length = _number(fields[b"content-length"], 10)
            if length > MAX_BODY:
                raise httpx.RemoteProtocolError(f"an answer of {length} bytes")
            body = await reader.readexactly(length)
        elif status in (204, 304):
            body = b""
        else:  # framed by the connection's end
            body = await _read_to_end(reader)
            keep = False
    except asyncio.IncompleteReadError as exc:
        raise httpx.RemoteProtocolError("Server disconnected without sending a complete response."
                                        if exc.partial or exc.expected else
                                        "Server disconnected without sending a response.") from None
    except asyncio.LimitOverrunError:
        raise httpx.RemoteProtocolError("an answer's header block is too long") from None
    except OSError as exc:
        raise httpx.ReadError(str(exc) or type(exc).__name__) from None
    return status, headers, body, keep


def _parse_head(head: bytes) -> tuple[bytes, int, list[tuple[bytes, bytes]]]:
    status_line, *lines = head[:-4].split(b"\r\n")
    version, _, rest = status_line.partition(b" ")
    if version not in (b"HTTP/1.1", b"HTTP/1.0"):
        raise httpx.RemoteProtocolError(f"not an HTTP/1 answer: {status_line[:40]!r}")
    headers = []
    for line in lines:
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip():
            raise httpx.RemoteProtocolError(f"a malformed header line: {line[:40]!r}")
        headers.append((name, value.strip()))
    return version, _number(rest[:3], 10), headers


async def _read_to_end(reader: asyncio.StreamReader) -> bytes:
    body = bytearray()
    while chunk := await reader.read(64 * 1024):
        body += chunk
        if len(body) > MAX_BODY:
            raise httpx.RemoteProtocolError("an answer longer than expected")
    return bytes(body)


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    body = bytearray()
    while True:
        size = _number((await reader.readuntil(b"\r\n")).split(b";", 1)[0].strip(), 16)
        if len(body) + size > MAX_BODY:
            raise httpx.RemoteProtocolError("an answer longer than expected")
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":  # trailer fields, then the end
                pass
            return bytes(body)
        body += await reader.readexactly(size)
        if await reader.readexactly(2) != b"\r\n":
            raise httpx.RemoteProtocolError("a chunk without its line end")


def _number(text: bytes, base: int) -> int:
    if not text or not text.isalnum():
        raise httpx.RemoteProtocolError(f"not a number: {text[:20]!r}")
    try:
        return int(text, base)
    except ValueError:
        raise httpx.RemoteProtocolError(f"not a number: {text[:20]!r}") from None
