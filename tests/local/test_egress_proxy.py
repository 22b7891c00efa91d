"""The host-side egress proxy, end to end over loopback TCP.

Only servers this file starts on 127.0.0.1 (and, where a denied/never-contacted address is
needed, ::1) are involved; nothing leaves the machine.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv6Address, ip_address

import pytest

from sandbox_kernel.local.egress_proxy import BLOCKED_REASON, Decision, EgressProxy

LOCAL = "127.0.0.1"


# ---------------------------------------------------------------------- tiny servers


@dataclass
class Server:
    port: int
    server: asyncio.AbstractServer
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)


async def _start(handler) -> Server:
    box: dict[str, Server] = {}

    async def counted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        box["s"].connections += 1
        try:
            await handler(box["s"], reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(counted, LOCAL, 0)
    box["s"] = Server(server.sockets[0].getsockname()[1], server)
    return box["s"]


def http_answering(text: str):
    async def handler(s: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        s.requests.append(head)
        body = text.encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n"
                     b"Connection: close\r\n\r\n%s" % (len(body), body))
        await writer.drain()

    return handler


async def echo(s: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while chunk := await reader.read(65536):
        writer.write(chunk)
        await writer.drain()


async def count_then_answer(s: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Reads until the client half-closes, then answers with how much it got."""
    total = 0
    while chunk := await reader.read(65536):
        total += len(chunk)
    writer.write(b"got %d bytes" % total)
    await writer.drain()


@dataclass
class Env:
    a: Server
    b: Server
    proxy: EgressProxy
    port: int
    decided: list[tuple[str | None, str, int]]
    finished: list[int]
    errors: list[BaseException]


async def _serve_proxy(proxy: EgressProxy, finished: list[int], errors: list[BaseException]):
    async def tracked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        finished.append(0)  # one 0 per started handle(), turned into 1 when it returns
        slot = len(finished) - 1
        try:
            await proxy.handle(reader, writer)
        except Exception as exc:  # handle() must never raise (cancellation aside)
            errors.append(exc)
            raise
        finally:
            finished[slot] = 1

    server = await asyncio.start_server(tracked, LOCAL, 0)
    return server, server.sockets[0].getsockname()[1]


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    a = await _start(http_answering("A"))
    b = await _start(http_answering("B"))
    decided: list[tuple[str | None, str, int]] = []

    def decide(host: str | None, addr: IPv4Address | IPv6Address, port: int) -> Decision:
        decided.append((host, str(addr), port))
        if addr == IPv4Address(LOCAL) and port == a.port:
            return Decision(True, "server A is allowed")
        return Decision(False, "not on the allowlist")

    proxy = EgressProxy(decide, connect_timeout=5.0)
    finished: list[int] = []
    errors: list[BaseException] = []
    server, port = await _serve_proxy(proxy, finished, errors)
    try:
        yield Env(a, b, proxy, port, decided, finished, errors)
    finally:
        await _wait_finished(finished)
        for s in (server, a.server, b.server):
            s.close()
        assert not errors
        assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("egress-relay")]


async def _open(port: int):
    return await asyncio.open_connection(LOCAL, port)


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {k.lower(): v.strip() for k, _, v in (l.partition(":") for l in lines[1:] if l)}
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    else:
        body = await reader.read()
    return status, headers, body


async def _connect_tunnel(port: int, target: str):
    reader, writer = await _open(port)
    writer.write(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    return reader, writer, head


async def _wait_finished(finished: list[int], n: int | None = None) -> None:
    """Wait until n handle() calls (default: every one started so far) have returned."""
    for _ in range(300):
        if sum(finished) >= (len(finished) if n is None else n):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"only {sum(finished)} of {n or len(finished)} handle() calls finished")


# ---------------------------------------------------------------------- HTTP CONNECT


async def test_connect_allowed_and_denied(env: Env) -> None:
    reader, writer, head = await _connect_tunnel(env.port, f"{LOCAL}:{env.a.port}")
    assert head == b"HTTP/1.1 200 Connection established\r\n\r\n"
    writer.write(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")
    status, _, body = await _read_response(reader)
    assert (status, body) == (200, b"A")
    writer.close()

    reader, writer = await _open(env.port)
    writer.write(f"CONNECT {LOCAL}:{env.b.port} HTTP/1.1\r\n\r\n".encode())
    status, headers, body = await _read_response(reader)
    assert status == 403
    assert headers["content-type"] == "text/plain"
    assert headers["connection"] == "close"
    assert body == f"egress denied: {LOCAL}:{env.b.port}: not on the allowlist\n".encode()
    assert await reader.read() == b""  # and the proxy closed
    writer.close()

    assert env.proxy.allowed_count == 1
    assert env.proxy.denied_count == 1
    denial = env.proxy.denials[-1]
    assert (denial.host, denial.port, denial.reason) == (LOCAL, env.b.port, "not on the allowlist")
    assert denial.at > 0
    assert env.b.connections == 0  # denied without ever touching B
    assert (None, LOCAL, env.b.port) in env.decided  # IP literal: hostname is None


async def test_connect_ipv6_literal_and_malformed(env: Env) -> None:
    reader, writer = await _open(env.port)
    writer.write(f"CONNECT [::1]:{env.a.port} HTTP/1.1\r\n\r\n".encode())
    status, _, body = await _read_response(reader)
    assert status == 403
    assert body.startswith(f"egress denied: [::1]:{env.a.port}: ".encode())
    writer.close()
    for bad in (b"CONNECT nohostport HTTP/1.1\r\n\r\n", b"CONNECT 127.0.0.1:99999 HTTP/1.1\r\n\r\n",
                b"CONNECT [::1 HTTP/1.1\r\n\r\n", b"GET /relative HTTP/1.1\r\n\r\n",
                b"CONNECT bad_host!:80 HTTP/1.1\r\n\r\n"):
        reader, writer = await _open(env.port)
        writer.write(bad)
        status, _, _ = await _read_response(reader)
        assert status == 400, bad
        writer.close()
    assert env.a.connections == 0


async def test_unreachable_is_502() -> None:
    # A port with nothing listening: bind, note the port, close.
    sock = socket.socket()
    sock.bind((LOCAL, 0))
    dead = sock.getsockname()[1]
    sock.close()
    proxy = EgressProxy(lambda h, a, p: Decision(True, "all"))
    finished: list[int] = []
    server, port = await _serve_proxy(proxy, finished, [])
    try:
        reader, writer = await _open(port)
        writer.write(f"CONNECT {LOCAL}:{dead} HTTP/1.1\r\n\r\n".encode())
        status, _, body = await _read_response(reader)
        assert status == 502
        assert body.count(b"\n") == 1 and b"refused" in body
        writer.close()
    finally:
        await _wait_finished(finished)
        server.close()


# ---------------------------------------------------------------------- plain HTTP


async def test_plain_http_proxy(env: Env) -> None:
    reader, writer = await _open(env.port)
    writer.write(f"GET http://{LOCAL}:{env.a.port}/x?y=1 HTTP/1.1\r\nHost: {LOCAL}:{env.a.port}\r\n"
                 f"Proxy-Connection: keep-alive\r\nProxy-Authorization: Basic Zm9vOmJhcg==\r\n"
                 f"X-Custom: kept\r\n\r\n".encode())
    status, _, body = await _read_response(reader)
    assert (status, body) == (200, b"A")
    writer.close()
    sent = env.a.requests[-1].decode()
    assert sent.startswith("GET /x?y=1 HTTP/1.1\r\n")
    assert "X-Custom: kept" in sent and "Connection: close" in sent
    assert "proxy-" not in sent.lower()

    reader, writer = await _open(env.port)
    writer.write(f"GET http://{LOCAL}:{env.b.port}/ HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    status, _, body = await _read_response(reader)
    assert status == 403 and f"{LOCAL}:{env.b.port}".encode() in body
    writer.close()
    assert env.b.connections == 0


async def test_urllib_through_proxy(env: Env) -> None:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": f"http://{LOCAL}:{env.port}"}))

    def fetch(port: int) -> bytes:
        with opener.open(f"http://{LOCAL}:{port}/", timeout=5) as resp:
            return resp.read()

    assert await asyncio.to_thread(fetch, env.a.port) == b"A"
    with pytest.raises(urllib.error.HTTPError) as info:
        await asyncio.to_thread(fetch, env.b.port)
    assert info.value.code == 403
    info.value.close()
    assert env.b.connections == 0


# ---------------------------------------------------------------------- SOCKS5


def _socks(port: int, request: bytes, methods: bytes = b"\x00") -> tuple[bytes, bytes, socket.socket]:
    """Greets, sends one request; returns (method reply, request reply, socket)."""
    sock = socket.create_connection((LOCAL, port), timeout=5)
    sock.sendall(b"\x05" + bytes([len(methods)]) + methods)
    method = _recv_exactly(sock, 2)
    if method != b"\x05\x00":
        return method, b"", sock
    sock.sendall(request)
    head = _recv_exactly(sock, 4)
    if not head:
        return method, b"", sock
    rest = _recv_exactly(sock, (4 if head[3] == 1 else 16) + 2)
    return method, head + rest, sock


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            break
        buf += chunk
    return buf


def _recv_all(sock: socket.socket) -> bytes:
    buf = b""
    while chunk := sock.recv(65536):
        buf += chunk
    return buf


def _ipv4_req(port: int, cmd: int = 1) -> bytes:
    return b"\x05" + bytes([cmd]) + b"\x00\x01" + socket.inet_aton(LOCAL) + struct.pack(">H", port)


def _domain_req(name: str, port: int) -> bytes:
    return b"\x05\x01\x00\x03" + bytes([len(name)]) + name.encode() + struct.pack(">H", port)


async def test_socks5(env: Env) -> None:
    def run() -> None:
        for request in (_ipv4_req(env.a.port), _domain_req("localhost", env.a.port)):
            method, reply, sock = _socks(env.port, request)
            assert method == b"\x05\x00"
            assert reply[:2] == b"\x05\x00", reply
            sock.sendall(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")
            assert _recv_all(sock).endswith(b"\r\n\r\nA")
            sock.close()
        for request in (_ipv4_req(env.b.port), _domain_req("localhost", env.b.port)):
            _, reply, sock = _socks(env.port, request)
            assert reply[:2] == b"\x05\x02", reply
            assert _recv_all(sock) == b""
            sock.close()
        _, reply, sock = _socks(env.port, _ipv4_req(env.a.port, cmd=2))  # BIND
        assert reply[:2] == b"\x05\x07"
        sock.close()
        method, _, sock = _socks(env.port, b"", methods=b"\x02")  # username/password only
        assert method == b"\x05\xff"
        assert _recv_all(sock) == b""
        sock.close()

    await asyncio.to_thread(run)
    assert env.b.connections == 0
    assert env.a.connections == 2
    assert ("localhost", LOCAL, env.a.port) in env.decided
    assert env.proxy.denied_count == 2
    await _wait_finished(env.finished, 6)


# ---------------------------------------------------------------------- resolution policy


class SpyProxy(EgressProxy):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.connected: list[tuple[str, int]] = []

    async def _connect(self, addr, port):
        self.connected.append((str(addr), port))
        return await super()._connect(addr, port)


async def _get_via_connect(port: int, target: str) -> bytes:
    reader, writer, head = await _connect_tunnel(port, target)
    assert head.startswith(b"HTTP/1.1 200"), head
    writer.write(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")
    _, _, body = await _read_response(reader)
    writer.close()
    return body


async def test_multiple_addresses_only_allowed_one_is_used() -> None:
    a = await _start(http_answering("A"))
    calls: list[tuple[str | None, str, int]] = []

    async def resolve(host: str, port: int) -> list:
        return [ip_address("::1"), ip_address(LOCAL)]  # the denied one first

    def decide(host, addr, port):
        calls.append((host, str(addr), port))
        return Decision(str(addr) == LOCAL, "v4 only")

    proxy = SpyProxy(decide, resolve=resolve)
    finished: list[int] = []
    server, port = await _serve_proxy(proxy, finished, [])
    try:
        assert await _get_via_connect(port, f"svc.example:{a.port}") == b"A"
        assert calls == [("svc.example", "::1", a.port), ("svc.example", LOCAL, a.port)]
        assert proxy.connected == [(LOCAL, a.port)]
    finally:
        await _wait_finished(finished)
        server.close()
        a.server.close()


async def test_no_dns_rebinding() -> None:
    a = await _start(http_answering("A"))
    answers = [[ip_address(LOCAL)], [ip_address("::1")]]
    resolved: list[str] = []

    async def resolve(host: str, port: int) -> list:
        resolved.append(host)
        return answers[min(len(resolved), 2) - 1]

    proxy = SpyProxy(lambda h, addr, p: Decision(str(addr) == LOCAL, "v4 only"), resolve=resolve)
    finished: list[int] = []
    server, port = await _serve_proxy(proxy, finished, [])
    try:
        assert await _get_via_connect(port, f"rebind.example:{a.port}") == b"A"
        assert resolved == ["rebind.example"]  # exactly once per connection
        assert proxy.connected == [(LOCAL, a.port)]  # the checked IP, not a second answer
        # The next connection resolves again and gets the rebound (denied) answer.
        reader, writer, head = await _connect_tunnel(port, f"rebind.example:{a.port}")
        assert head.startswith(b"HTTP/1.1 403")
        writer.close()
        assert resolved == ["rebind.example"] * 2
        assert proxy.connected == [(LOCAL, a.port)]
    finally:
        await _wait_finished(finished)
        server.close()
        a.server.close()


async def test_blocked_beats_allow_all() -> None:
    engine = await _start(http_answering("engine"))

    async def resolve(host: str, port: int) -> list:
        return [ip_address(LOCAL)]

    proxy = EgressProxy(lambda h, a, p: Decision(True, "allow all"), resolve=resolve,
                        blocked_ports=[engine.port])
    finished: list[int] = []
    server, port = await _serve_proxy(proxy, finished, [])
    try:
        for target in (f"{LOCAL}:{engine.port}", f"[::ffff:{LOCAL}]:{engine.port}",
                       f"engine.example:{engine.port}", f"0.0.0.0:{engine.port}",
                       f"[::ffff:0.0.0.0]:{engine.port}", f"[::]:{engine.port}", f"127.9.9.9:{engine.port}"):
            reader, writer = await _open(port)
            writer.write(f"CONNECT {target} HTTP/1.1\r\n\r\n".encode())
            status, _, body = await _read_response(reader)
            assert status == 403, target
            assert body.endswith(f": {BLOCKED_REASON}\n".encode())
            writer.close()
        assert engine.connections == 0
        assert proxy.denied_count == 7 and proxy.allowed_count == 0
        assert proxy.denials[-1].reason == BLOCKED_REASON
    finally:
        await _wait_finished(finished)
        server.close()
        engine.server.close()


# ---------------------------------------------------------------------- robustness


async def test_garbage_and_truncation_close_cleanly(env: Env) -> None:
    inputs = [
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(256)),  # a TLS hello
        b"\x00\xff\xfe\r\n\r\n",
        b"\xff" * 100,
        b"",
        b"\x05",
        b"\x05\x02\x00",
        b"\x05\x01\x00\x05\x01\x00\x03\x10abc",
        b"\x05\x01\x00\x05\x01\x00\x09",  # unknown address type
        b"\x04\x01\x00\x50\x7f\x00\x00\x01\x00",  # SOCKS4
        b"GET http://" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n",
        b"GET http://127.0.0.1/ HTTP/1.1\r\nX-Big: " + b"x" * 70000 + b"\r\n\r\n",
        b"CONNECT 127.0.0.1:1 HTTP/1.1\r\nno colon here\r\n\r\n",
    ]
    for data in inputs:
        reader, writer = await _open(env.port)
        writer.write(data)
        writer.write_eof()
        await asyncio.wait_for(reader.read(), 5)  # whatever it says, it then closes
        writer.close()
    await _wait_finished(env.finished, len(inputs))
    assert env.a.connections == 0 and env.b.connections == 0


async def test_stuck_client_does_not_block_others(env: Env) -> None:
    _stuck_r, stuck_w = await _open(env.port)
    stuck_w.write(b"CONNECT 127.0.0.1:")  # and never finishes
    await stuck_w.drain()
    assert await _get_via_connect(env.port, f"{LOCAL}:{env.a.port}") == b"A"
    stuck_w.close()


async def test_relay_one_mib_and_half_close() -> None:
    echo_s = await _start(echo)
    counter = await _start(count_then_answer)
    proxy = EgressProxy(lambda h, a, p: Decision(True, "all"))
    finished: list[int] = []
    errors: list[BaseException] = []
    server, port = await _serve_proxy(proxy, finished, errors)
    try:
        payload = bytes(i * 7 % 251 for i in range(1 << 20))
        reader, writer, head = await _connect_tunnel(port, f"{LOCAL}:{echo_s.port}")
        assert head.startswith(b"HTTP/1.1 200")

        async def send() -> None:
            writer.write(payload)
            await writer.drain()
            writer.write_eof()

        sender = asyncio.create_task(send())
        got = await asyncio.wait_for(reader.read(-1), 10)
        await sender
        assert got == payload
        writer.close()

        reader, writer, head = await _connect_tunnel(port, f"{LOCAL}:{counter.port}")
        writer.write(b"x" * 1000)
        writer.write_eof()  # client shuts its write side; the server still answers
        assert await asyncio.wait_for(reader.read(-1), 5) == b"got 1000 bytes"
        writer.close()
        await _wait_finished(finished, 2)
        assert finished == [1, 1] and not errors
        assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("egress-relay")]
    finally:
        await _wait_finished(finished)
        server.close()
        echo_s.server.close()
        counter.server.close()


async def test_a_trickling_handshake_is_ended() -> None:
    """A client has handshake_timeout in all to name its destination: a SOCKS request sent
    a byte at a time, each well within that time, is still cut off."""
    proxy = EgressProxy(lambda h, a, p: Decision(True, "allow all"), handshake_timeout=0.3)
    finished: list[int] = []
    server, port = await _serve_proxy(proxy, finished, [])
    try:
        reader, writer = await _open(port)
        writer.write(b"\x05\x01\x00")
        assert await reader.readexactly(2) == b"\x05\x00"
        request = b"\x05\x01\x00\x03\xc8" + b"a" * 200 + b"\x01\xbb"  # 20 s at 0.1 s a byte
        sent = 0
        for byte in request:
            try:
                writer.write(bytes([byte]))
                if await asyncio.wait_for(reader.read(1), 0.1) == b"":
                    break  # closed by the proxy
            except asyncio.TimeoutError:
                sent += 1
            except ConnectionError:
                break
        assert sent < len(request)
        await _wait_finished(finished)
        writer.close()
    finally:
        server.close()


async def test_names_no_rule_allows_are_refused_before_resolving() -> None:
    resolved: list[str] = []

    async def resolve(host: str, port: int) -> list:
        resolved.append(host)
        return [ip_address(LOCAL)]

    proxy = EgressProxy(lambda h, a, p: Decision(True, "allowed"), resolve=resolve,
                        screen=lambda host, port: None if host == "named.example" else Decision(False, "unnamed"))
    finished: list[int] = []
    server, port = await _serve_proxy(proxy, finished, [])
    try:
        reader, writer = await _open(port)
        writer.write(b"CONNECT other.example:443 HTTP/1.1\r\n\r\n")
        status, _, body = await _read_response(reader)
        assert (status, body) == (403, b"egress denied: other.example:443: unnamed\n")
        writer.close()
        assert resolved == [] and proxy.denied_count == 1
    finally:
        await _wait_finished(finished)
        server.close()
