"""The input transport's HTTP (sandbox_kernel/api/kept_connections.py), against a server that
answers exactly as each test scripts it: framing, reuse, a server that closes, and failures
raised as the httpx exceptions callers map."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from sandbox_kernel.api.kept_connections import KeptConnections

Answer = Callable[[bytes, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class ScriptedServer:
    """Reads each request (head and Content-Length body) and lets `answer` reply."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.connections = 0
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                await self.answer(request, reader, writer)
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.sockets[0].getsockname()[1]


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Answer], Awaitable[tuple[ScriptedServer, KeptConnections]]]]:
    opened: list[tuple[ScriptedServer, KeptConnections]] = []

    async def start(answer: Answer) -> tuple[ScriptedServer, KeptConnections]:
        scripted = ScriptedServer(answer)
        scripted.server = await asyncio.start_server(scripted.handle, "127.0.0.1", 0)
        transport = KeptConnections(host="127.0.0.1", port=scripted.port)
        opened.append((scripted, transport))
        return scripted, transport

    yield start
    for scripted, transport in opened:
        await transport.aclose()
        assert scripted.server is not None
        scripted.server.close()


def post(body: bytes = b'{"data_base64": "eAo="}', read_timeout: float = 5.0) -> httpx.Request:
    return httpx.Request("POST", "http://127.0.0.1/v1/sandboxes/s/processes/p/input",
                         headers={"X-Api-Key": "k", "Content-Type": "application/json"}, content=body,
                         extensions={"timeout": {"connect": 5.0, "read": read_timeout, "write": 5.0, "pool": 5.0}})


async def send(transport: KeptConnections, request: httpx.Request) -> httpx.Response:
    """One call, its answer read whole (as the client reads an input call's)."""
    response = await transport.handle_async_request(request)
    await response.aread()
    return response


def reply(body: bytes, status: str = "200 OK", *headers: bytes) -> Answer:
    async def answer(_request: bytes, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s"
                     % (status.encode(), len(body), b"".join(h + b"\r\n" for h in headers), body))
        await writer.drain()
    return answer


async def test_an_answer_is_read_and_the_connection_kept_for_the_next_call(serve) -> None:
    scripted, transport = await serve(reply(b'{"status": "success", "data": {"input_seq": 1}}'))
    for _ in range(3):
        response = await send(transport, post())
        assert response.status_code == 200
        assert response.json() == {"status": "success", "data": {"input_seq": 1}}
    assert scripted.connections == 1
    request = scripted.requests[0]
    assert request.startswith(b"POST /v1/sandboxes/s/processes/p/input HTTP/1.1\r\n")
    assert b"\r\nx-api-key: k\r\n" in request.lower() and request.endswith(b'{"data_base64": "eAo="}')


async def test_an_error_answer_keeps_its_status_headers_and_body(serve) -> None:
    _, transport = await serve(reply(b'{"status": "error", "message": "no such process"}', "404 Not Found",
                                     b"retry-after: 3"))
    response = await send(transport, post())
    assert response.status_code == 404
    assert response.headers["retry-after"] == "3"
    assert response.json()["message"] == "no such process"


async def test_chunked_and_close_delimited_answers_are_read_whole(serve) -> None:
    async def chunked(_request: bytes, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                     b"5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\nx-trailer: 1\r\n\r\n")
        await writer.drain()

    scripted, transport = await serve(chunked)
    assert (await send(transport, post())).content == b"hello, world"
    assert (await send(transport, post())).content == b"hello, world"
    assert scripted.connections == 1

    async def until_close(_request: bytes, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * 100_000)
        await writer.drain()
        writer.close()

    scripted, transport = await serve(until_close)
    for _ in range(2):
        assert (await send(transport, post())).content == b"x" * 100_000
    assert scripted.connections == 2  # an answer framed by the close ends its connection


async def test_connection_close_and_http_1_0_are_not_reused(serve) -> None:
    scripted, transport = await serve(reply(b"{}", "200 OK", b"connection: close"))
    await send(transport, post())
    await send(transport, post())
    assert scripted.connections == 2


async def test_an_idle_connection_the_server_closed_is_not_reused(serve) -> None:
    async def once_then_close(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reply(b"{}")(request, reader, writer)
        writer.close()  # as a server ends an idle kept-alive connection

    scripted, transport = await serve(once_then_close)
    await send(transport, post())
    await asyncio.sleep(0.2)  # the close reaches this side (handled or not by the event loop)
    assert (await send(transport, post())).status_code == 200
    assert scripted.connections == 2 and len(scripted.requests) == 2


async def test_calls_at_the_same_time_each_get_a_connection(serve) -> None:
    async def slow(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(0.2)
        await reply(b"{}")(request, reader, writer)

    scripted, transport = await serve(slow)
    answers = await asyncio.gather(*(send(transport, post()) for _ in range(4)))
    assert [answer.status_code for answer in answers] == [200] * 4
    assert scripted.connections == 4
    await send(transport, post())
    assert scripted.connections == 4  # one of those kept was reused (at most KEEP_IDLE are kept)


@pytest.mark.parametrize("raw, error", [
    (b"", httpx.RemoteProtocolError),  # closed without an answer
    (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort", httpx.RemoteProtocolError),
    (b"SSH-2.0-OpenSSH\r\n\r\n", httpx.RemoteProtocolError),
    (b"HTTP/1.1 200 OK\r\n bad header\r\n\r\n", httpx.RemoteProtocolError),
    (b"HTTP/1.1 2x0 OK\r\ncontent-length: 0\r\n\r\n", httpx.RemoteProtocolError),
    (b"HTTP/1.1 200 OK\r\ncontent-length: 99999999\r\n\r\n", httpx.RemoteProtocolError),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n", httpx.RemoteProtocolError),
])
async def test_a_broken_answer_is_a_protocol_error_and_the_connection_is_dropped(serve, raw: bytes,
                                                                                   error: type[Exception]) -> None:
    answers = [raw]

    async def broken_then_good(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if answers:
            writer.write(answers.pop())
            await writer.drain()
            writer.close()
            return
        await reply(b"{}")(request, reader, writer)

    scripted, transport = await serve(broken_then_good)
    with pytest.raises(error):
        await send(transport, post())
    assert (await send(transport, post())).status_code == 200
    assert scripted.connections == 2


async def test_a_silent_server_is_a_read_timeout_and_a_closed_port_a_connect_error(serve) -> None:
    async def silent(_request: bytes, reader: asyncio.StreamReader, _writer: asyncio.StreamWriter) -> None:
        await reader.read()

    scripted, transport = await serve(silent)
    with pytest.raises(httpx.ReadTimeout):
        await send(transport, post(read_timeout=0.3))
    port = scripted.port
    assert scripted.server is not None
    scripted.server.close()
    await scripted.server.wait_closed()
    with pytest.raises(httpx.ConnectError):
        await send(KeptConnections(host="127.0.0.1", port=port), post())


async def test_a_streamed_answer_arrives_as_written_and_an_abandoned_one_is_not_reused(serve) -> None:
    rest = asyncio.Event()

    async def two_pieces(_request: bytes, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await rest.wait()
        writer.write(b"6\r\nsecond\r\n0\r\n\r\n")
        await writer.drain()

    scripted, transport = await serve(two_pieces)
    response = await transport.handle_async_request(post())
    pieces = response.aiter_raw()
    assert await anext(pieces) == b"first"  # before the server wrote the rest
    rest.set()
    assert [piece async for piece in pieces] == [b"second"]
    await send(transport, post())
    assert scripted.connections == 1  # read to its end: the connection served the next call

    rest.clear()
    response = await transport.handle_async_request(post())
    assert await anext(response.aiter_raw()) == b"first"
    await response.aclose()  # left mid-answer: its rest must not be read as the next answer
    rest.set()
    await send(transport, post())
    assert scripted.connections == 2


async def test_a_stream_silent_longer_than_the_read_timeout_fails_with_read_timeout(serve) -> None:
    async def one_piece(_request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await reader.read()

    _, transport = await serve(one_piece)
    response = await transport.handle_async_request(post(read_timeout=0.3))
    pieces = response.aiter_raw()
    assert await anext(pieces) == b"first"
    with pytest.raises(httpx.ReadTimeout):
        await anext(pieces)


async def test_prepare_opens_the_next_calls_connection_ahead_and_a_refusal_is_left_to_that_call(serve) -> None:
    scripted, transport = await serve(reply(b"{}"))
    await transport.prepare(timeout=5.0)
    await transport.prepare(timeout=5.0)  # one is ready already: no second
    assert scripted.connections == 1
    await send(transport, post())
    assert scripted.connections == 1 and len(scripted.requests) == 1

    port = scripted.port
    assert scripted.server is not None
    scripted.server.close()
    await scripted.server.wait_closed()
    closed = KeptConnections(host="127.0.0.1", port=port)
    await closed.prepare(timeout=5.0)  # nothing raised, nothing kept
    with pytest.raises(httpx.ConnectError):
        await send(closed, post())
