"""A managed process's calls over kept-alive HTTP/1.1 connections of our own.

Every cell, output acknowledgement and comm message is one ``POST .../processes/:pid/input``
with a body of a few hundred bytes and an answer of a few dozen, and every event of the
sandbox comes back on the process's ``connect`` stream. Through httpx's client and
httpcore's pool an input call cost the kernel 3.7 ms of CPU on the 2-core machine this was
measured on (URL and header models, the pool, h11's state machine, anyio's streams, each a
layer of coroutines), on every cell's path before the sandbox has its code; written and read
directly over a kept connection, 0.3 ms. This transport does only that much HTTP: a request
whose body is given whole; an answer framed by Content-Length, chunked encoding or the
connection's end, read as the caller iterates it; no compression (none is asked for), no
redirects, no proxy (the client does not use it where one would apply). Failures are httpx's
exceptions, the ones httpcore raises in the same cases, so callers (the client's error
mapping, the local engine's restarting transport) treat them as from any transport.
"""

from __future__ import annotations

import asyncio
import select
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import httpx

T = TypeVar("T")

# The stream's buffer (asyncio reads ahead up to twice this) and the longest header block.
BUFFER = 256 * 1024
# httpcore's words for an answer cut short.
INCOMPLETE = "Server disconnected without sending a complete response."
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
            read_timeout = timeouts.get("read")
            version, status, headers = await _with_timeout(_read_head(connection.reader), read_timeout)
        except BaseException:  # its state is unknown (cancelled mid-answer, say): never reused
            connection.close()
            raise
        body = _Body(connection, _framing(version, status, headers), read_timeout, self._release)
        return httpx.Response(status, headers=headers, stream=body, request=request)

    async def prepare(self, timeout: float) -> None:
        """Open a connection ahead of the next call, so that it does not wait for a TCP and TLS
        handshake (a failure here is left for that call to meet and report)."""
        if not self._idle:
            try:
                self._release(await _with_timeout(self._open(), timeout, httpx.ConnectTimeout))
            except httpx.TransportError:
                pass

    async def aclose(self) -> None:
        while self._idle:
            self._idle.pop().close()

    def _release(self, connection: _Connection) -> None:
        """A connection whose answer was read to its end, for the next call."""
        if len(self._idle) < KEEP_IDLE:
            self._idle.append(connection)
        else:
            connection.close()

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
                reader, writer = await asyncio.open_unix_connection(self._uds, limit=BUFFER)
            else:
                if self._tls is not None and self._tls_context is None:
                    self._tls_context = self._tls()
                reader, writer = await asyncio.open_connection(
                    self._host, self._port, limit=BUFFER, ssl=self._tls_context,
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


class _Framing:
    """How an answer's body ends: after `length` bytes, with chunked encoding's last chunk,
    or with the connection (`length` None, not chunked); `keep`: the connection may serve
    another request then."""

    def __init__(self, length: int | None, chunked: bool, keep: bool) -> None:
        self.length = length
        self.chunked = chunked
        self.keep = keep and (chunked or length is not None)


def _framing(version: bytes, status: int, headers: list[tuple[bytes, bytes]]) -> _Framing:
    fields = {name.lower(): value for name, value in headers}
    connection = fields.get(b"connection", b"").lower()
    keep = b"keep-alive" in connection if version == b"HTTP/1.0" else b"close" not in connection
    if b"chunked" in fields.get(b"transfer-encoding", b"").lower():
        return _Framing(None, True, keep)
    if b"content-length" in fields:
        return _Framing(_number(fields[b"content-length"], 10), False, keep)
    if status in (204, 304):
        return _Framing(0, False, keep)
    return _Framing(None, False, keep)


class _Body(httpx.AsyncByteStream):
    """An answer's body, read from its connection as it is iterated; the connection goes
    back for reuse once the body was read to its end, and is closed if it was not."""

    def __init__(self, connection: _Connection, framing: _Framing, read_timeout: float | None,
                 release: Callable[[_Connection], None]) -> None:
        self._connection: _Connection | None = connection
        self._framing = framing
        self._read_timeout = read_timeout
        self._release = release

    async def __aiter__(self) -> AsyncIterator[bytes]:
        connection = self._connection
        if connection is None:
            raise httpx.StreamClosed()
        try:
            async for piece in self._pieces(connection.reader):
                yield piece
        except BaseException:
            await self.aclose()
            raise
        self._connection = None
        if self._framing.keep:
            self._release(connection)
        else:
            connection.close()

    async def aclose(self) -> None:
        if self._connection is not None:  # not read to its end: what is left would be read as the next answer
            self._connection.close()
            self._connection = None

    async def _pieces(self, reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
        framing = self._framing
        if framing.chunked:
            while size := _number((await self._read(reader.readuntil(b"\r\n"))).split(b";", 1)[0].strip(), 16):
                while size:
                    piece = await self._piece(reader, size)
                    size -= len(piece)
                    yield piece
                if await self._read(reader.readexactly(2)) != b"\r\n":
                    raise httpx.RemoteProtocolError("a chunk without its line end")
            while await self._read(reader.readuntil(b"\r\n")) != b"\r\n":  # trailer fields, then the end
                pass
        elif framing.length is not None:
            left = framing.length
            while left:
                piece = await self._piece(reader, left)
                left -= len(piece)
                yield piece
        else:
            while piece := await self._read(reader.read(BUFFER)):
                yield piece

    async def _piece(self, reader: asyncio.StreamReader, left: int) -> bytes:
        """What has arrived of the next `left` bytes (at least one): passed on as it comes, as
        the stream's buffer would otherwise fill and be copied whole each time it grows."""
        piece = await self._read(reader.read(min(left, BUFFER)))
        if not piece:
            raise httpx.RemoteProtocolError(INCOMPLETE)
        return piece

    async def _read(self, operation: Awaitable[T]) -> T:
        return await _with_timeout(_as_protocol_errors(operation), self._read_timeout)


async def _read_head(reader: asyncio.StreamReader) -> tuple[bytes, int, list[tuple[bytes, bytes]]]:
    """The answer's HTTP version, status and headers (interim 1xx answers skipped)."""
    while True:
        version, status, headers = _parse_head(await _as_protocol_errors(reader.readuntil(b"\r\n\r\n")))
        if not 100 <= status < 200:
            return version, status, headers


async def _as_protocol_errors(operation: Awaitable[T]) -> T:
    """A read, its failures as the httpx exceptions httpcore raises for them."""
    try:
        return await operation
    except asyncio.IncompleteReadError as exc:
        raise httpx.RemoteProtocolError(INCOMPLETE if exc.partial or exc.expected else
                                        "Server disconnected without sending a response.") from None
    except asyncio.LimitOverrunError:
        raise httpx.RemoteProtocolError("an answer's header or chunk line is too long") from None
    except OSError as exc:
        raise httpx.ReadError(str(exc) or type(exc).__name__) from None


async def _with_timeout(operation: Awaitable[T], timeout: float | None,
                        error: type[httpx.TimeoutException] = httpx.ReadTimeout) -> T:
    try:
        async with asyncio.timeout(timeout):
            return await operation
    except TimeoutError:
        raise error("timed out") from None


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


def _number(text: bytes, base: int) -> int:
    if not text or not text.isalnum():
        raise httpx.RemoteProtocolError(f"not a number: {text[:20]!r}")
    try:
        return int(text, base)
    except ValueError:
        raise httpx.RemoteProtocolError(f"not a number: {text[:20]!r}") from None
