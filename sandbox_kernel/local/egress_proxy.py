"""The host-side egress proxy: every outbound connection a sandbox makes comes through here.

Sandboxes have no network device but their own loopback; the engine tunnels each of their
outbound streams to `EgressProxy.handle`, which speaks the two protocols programs use to
ask for a proxy -- an HTTP proxy (``CONNECT host:port`` tunnels and absolute-URI plain-HTTP
requests) and SOCKS5 (RFC 1928, no auth, CONNECT only) -- told apart by the first byte.

Policy, in this order: ``screen(hostname, port)`` first refuses a name that no rule could
allow whatever it resolves to, *without resolving it* (so a sandbox under block-all sends
nothing out, not even a DNS query). Otherwise the name is resolved *here*, on the host,
exactly once per connection; every resolved address is put to
``decide(hostname, address, port)`` and the proxy connects only to an address that was
allowed -- the very IP that was checked, so a second DNS answer can never change where the
bytes go (no DNS rebinding). An IP literal is checked as ``decide(None, ip, port)``.
``blocked_ports`` are closed on every address of the host itself (loopback, 0.0.0.0, ::,
its interfaces' addresses, in any spelling) whatever the rules say: the engine's own API.
A denied attempt fails fast, without any connection attempt, and is recorded in
``denials`` / ``denied_count``.

Name lookups block a thread for as long as the resolver takes, and a resolver that never
answers takes the thread's whole life: each runs in a daemon thread of its own (never in
asyncio's default executor, which the engine's own blocking work uses), at most
``max_lookups`` at once per proxy (one proxy serves one sandbox). A lookup counts until its
thread returns, not until the connection gives up on it after ``lookup_timeout``: past the
budget a connection is refused at once, saying why (``refused_lookups``), so one sandbox's
hung lookups cost the host a bounded number of threads and nobody else any.

Tunnels stay registered while they relay: ``cut_disallowed`` ends those the current rules
no longer allow (after a rule change).

Everything stays inside ``handle``: every error path closes both sides, the relay tasks
are always cancelled and awaited, and no input -- however malformed -- raises out of it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import ipaddress
import logging
import re
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address
from urllib.parse import urlsplit

from sandbox_kernel.api.egress_rules import Decision
from sandbox_kernel.local.egress_destinations import DestinationLog

log = logging.getLogger(__name__)

IPAddress = IPv4Address | IPv6Address
Decide = Callable[[str | None, IPAddress, int], Decision]
Screen = Callable[[str, int], Decision | None]
Resolve = Callable[[str, int], Awaitable[list[IPAddress]]]

BLOCKED_REASON = "the sandbox engine's API is never reachable from a sandbox"
MAX_HEADER_BYTES = 64 * 1024
RELAY_CHUNK = 64 * 1024
MAX_LOOKUPS = 8  # name lookups one sandbox may have unanswered at once
LOOKUP_TIMEOUT = 10.0  # how long a connection waits for its lookup

_HOSTNAME_RE = re.compile(r"^(?=.{1,253}$)[a-z0-9_](?:[a-z0-9_-]{0,62})(?:\.[a-z0-9_](?:[a-z0-9_-]{0,62}))*$")
_DROP_UPSTREAM = {"proxy-connection", "proxy-authorization", "connection", "keep-alive"}

# SOCKS5 reply codes (RFC 1928 section 6).
SOCKS_OK = 0x00
SOCKS_FAILURE = 0x01
SOCKS_NOT_ALLOWED = 0x02
SOCKS_NET_UNREACHABLE = 0x03
SOCKS_HOST_UNREACHABLE = 0x04
SOCKS_REFUSED = 0x05
SOCKS_TTL_EXPIRED = 0x06
SOCKS_BAD_COMMAND = 0x07
SOCKS_BAD_ADDRESS_TYPE = 0x08


@dataclass(frozen=True)
class Tunnel:
    """An open connection through the proxy, as it was decided."""

    host: str  # as requested
    hostname: str | None  # normalized name, None for an IP literal
    address: IPAddress
    port: int


@dataclass
class Denial:
    at: float  # time.time()
    host: str  # as requested: hostname or IP literal
    port: int
    reason: str


class _BadRequest(Exception):
    """The client sent something we cannot parse (HTTP 400 / SOCKS general failure)."""


class _Denied(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _Unreachable(Exception):
    """Resolution or connection failed; carries the SOCKS reply code to use."""

    def __init__(self, reason: str, socks_code: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.socks_code = socks_code


def _normalize(addr: IPAddress) -> IPAddress:
    """Treat an IPv4-mapped IPv6 address (::ffff:a.b.c.d) as the IPv4 address it is."""
    if isinstance(addr, IPv6Address):
        mapped = addr.ipv4_mapped
        if mapped is not None:
            return mapped
        if addr.scope_id:
            return IPv6Address(str(addr).split("%", 1)[0])
    return addr


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _parse_ip(host: str) -> IPAddress | None:
    try:
        return _normalize(ipaddress.ip_address(host))
    except ValueError:
        return None


def is_host_address(addr: IPAddress) -> bool:
    """Whether addr reaches the host itself: loopback, unspecified (which connects to the
    host), or an address of one of its interfaces (one it can bind)."""
    if addr.is_loopback or addr.is_unspecified:
        return True
    family = socket.AF_INET6 if isinstance(addr, IPv6Address) else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((str(addr), 0))
        except OSError:
            return False
    return True


def _in_daemon_thread(call: Callable[[], object]) -> asyncio.Future:
    """call() in a new daemon thread; its outcome as a future of the running loop. A daemon
    thread, as a hung lookup must hold up neither the engine's other work nor its exit."""
    loop = asyncio.get_running_loop()
    outcome: asyncio.Future = loop.create_future()

    def settle(result: object, error: BaseException | None) -> None:
        if outcome.done():
            return
        if error is not None:
            outcome.set_exception(error)
        else:
            outcome.set_result(result)

    def run() -> None:
        try:
            result, error = call(), None
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="egress-lookup", daemon=True).start()
    return outcome


async def _default_resolve(host: str, port: int) -> list[IPAddress]:
    infos = await _in_daemon_thread(lambda: socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
    out: list[IPAddress] = []
    for _family, _type, _proto, _canon, sockaddr in infos:
        try:
            addr = _normalize(ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0]))
        except ValueError:
            continue
        if addr not in out:
            out.append(addr)
    return out


class RefusalLog:
    """The engine log's lines about one sandbox's refused connections. A sandbox can make
    thousands a second (100k in 30 s grew the log by 60 MiB), so the first FIRST_LINES are
    logged one by one, then one line per SUMMARY_INTERVAL seconds says how many more there
    were. The log is for the engine's operator; every refusal is still counted and the
    newest are kept for `%egress` (EgressProxy.denied_count, .denials)."""

    FIRST_LINES = 20
    SUMMARY_INTERVAL = 60.0

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.logged = 0
        self.unlogged = 0  # refusals since the last line
        self._next_summary = 0.0

    def refused(self, where: str, reason: str) -> None:
        if self.logged < self.FIRST_LINES:
            self.logged += 1
            log.info("egress denied: %s: %s", where, reason)
            if self.logged == self.FIRST_LINES:
                log.info("egress denied %d connections of this sandbox: further refusals are "
                         "summed up every %.0f s", self.logged, self.SUMMARY_INTERVAL)
                self._next_summary = self._clock() + self.SUMMARY_INTERVAL
            return
        self.unlogged += 1
        now = self._clock()
        if now >= self._next_summary:
            log.info("egress denied %d more connections of this sandbox (last: %s: %s)",
                     self.unlogged, where, reason)
            self.unlogged = 0
            self._next_summary = now + self.SUMMARY_INTERVAL


class EgressProxy:
    """Serves sandbox egress connections one stream pair at a time (see module docstring).

    ``allowed_count`` counts connections the policy allowed (whether or not the upstream
    then answered); ``denied_count`` counts connections the policy denied.
    """

    def __init__(
        self,
        decide: Decide,
        *,
        screen: Screen | None = None,
        resolve: Resolve | None = None,
        blocked_ports: Iterable[int] = (),
        connect_timeout: float = 10.0,
        keep_denials: int = 50,
        handshake_timeout: float = 10.0,
        max_lookups: int = MAX_LOOKUPS,
        lookup_timeout: float = LOOKUP_TIMEOUT,
    ) -> None:
        self._decide = decide
        self._screen = screen or (lambda _host, _port: None)
        self._resolve = resolve or _default_resolve
        self._blocked_ports = frozenset(blocked_ports)
        self._tunnels: dict[asyncio.Task, Tunnel] = {}  # the task relaying each open tunnel
        # A client has handshake_timeout in all to say where it goes: one trickling a byte
        # at a time would otherwise hold the connection (and the engine's descriptors) forever.
        self._handshakes: dict[asyncio.Task, asyncio.TimerHandle] = {}
        self.connect_timeout = connect_timeout
        self.handshake_timeout = handshake_timeout
        self.max_lookups = max_lookups
        self.lookup_timeout = lookup_timeout
        self._lookups: set[asyncio.Task] = set()  # lookups whose resolver has not returned yet
        self.refused_lookups = 0  # connections refused because max_lookups were unanswered
        self.denials: collections.deque[Denial] = collections.deque(maxlen=keep_denials)
        self.denied_count = 0
        self.refusal_log = RefusalLog()
        self.allowed_count = 0
        self.destinations = DestinationLog()  # what the sandbox asked for, allowed or not (bounded)
        self.bytes_out = 0  # relayed from the sandbox to its destinations (CreateOS's used_bytes)
        self.bytes_in = 0  # relayed back into the sandbox (ingress_bytes)

    # ------------------------------------------------------------------ entry point

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream: asyncio.StreamWriter | None = None
        task = asyncio.current_task()
        if task is not None:
            self._handshakes[task] = asyncio.get_running_loop().call_later(
                self.handshake_timeout, task.cancel)
        try:
            try:
                first = await asyncio.wait_for(reader.read(1), self.handshake_timeout)
            except asyncio.TimeoutError:
                return
            if not first:
                return
            if first == b"\x05":
                upstream = await self._socks5(reader, writer)
            else:
                upstream = await self._http(first, reader, writer)
        except asyncio.CancelledError:
            raise
        except Exception:  # never let a client's garbage (or our bug) escape
            log.debug("egress connection failed", exc_info=True)
        finally:
            self._handshake_done()
            self._tunnels.pop(task, None)  # type: ignore[arg-type]
            await _close(writer)
            if upstream is not None:
                await _close(upstream)

    def _traffic(self, outbound: bool, size: int) -> None:
        if outbound:
            self.bytes_out += size
        else:
            self.bytes_in += size

    # ------------------------------------------------------------------ policy + connect

    def _record_denial(self, host: str, port: int, reason: str) -> None:
        self.denied_count += 1
        self.denials.append(Denial(at=time.time(), host=host, port=port, reason=reason))
        self.refusal_log.refused(_hostport(host, port), reason)

    def _is_blocked(self, addr: IPAddress, port: int) -> bool:
        return port in self._blocked_ports and is_host_address(addr)

    def cut_disallowed(self) -> int:
        """End every open tunnel the current rules no longer allow; how many were cut."""
        cut = 0
        for task, tunnel in list(self._tunnels.items()):
            decision = self._check_one(tunnel.hostname, tunnel.address, tunnel.port)
            if not decision.allowed:
                self._record_denial(tunnel.host, tunnel.port, f"cut after a rule change: {decision.reason}")
                task.cancel()
                cut += 1
        return cut

    def _check_one(self, hostname: str | None, addr: IPAddress, port: int) -> Decision:
        if self._is_blocked(addr, port):
            return Decision(False, BLOCKED_REASON)
        try:
            decision = self._decide(hostname, addr, port)
        except Exception as exc:  # a broken rule denies, never allows
            log.warning("egress decide() raised", exc_info=True)
            return Decision(False, f"rule evaluation failed: {type(exc).__name__}")
        return decision

    def _handshake_done(self) -> None:
        timer = self._handshakes.pop(asyncio.current_task(), None)  # type: ignore[arg-type]
        if timer is not None:
            timer.cancel()

    async def _open(self, host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Authorize host:port, connect to an allowed address, and register the tunnel."""
        self._handshake_done()  # the client has said where it goes: resolving and connecting have their own timeouts
        hostname, addrs = await self._authorize(host, port)
        up_reader, up_writer = await self._connect_any(addrs, port)
        peer = _parse_ip(str((up_writer.get_extra_info("peername") or ("",))[0]).split("%", 1)[0])
        task = asyncio.current_task()
        if task is not None:
            self._tunnels[task] = Tunnel(host, hostname, peer or addrs[0], port)
        return up_reader, up_writer

    async def _authorize(self, host: str, port: int) -> tuple[str | None, list[IPAddress]]:
        """The normalized name (None for an IP literal) and its allowed addresses for
        host:port (in resolver order), or raise."""
        if not 1 <= port <= 65535:
            raise _BadRequest(f"bad port {port}")
        literal = _parse_ip(host)
        hostname: str | None = None
        if literal is not None:
            addrs = [literal]
        else:
            hostname = host.lower()
            if hostname.endswith("."):
                hostname = hostname[:-1]  # "example.com." is "example.com" to the rules
            if not _HOSTNAME_RE.match(hostname):
                raise _BadRequest(f"bad host name {host!r}")
            try:
                refusal = self._screen(hostname, port)
            except Exception as exc:  # a broken rule refuses, never allows
                refusal = Decision(False, f"rule evaluation failed: {type(exc).__name__}")
            if refusal is not None:
                self.destinations.seen(hostname, port, allowed=False)
                self._record_denial(host, port, refusal.reason)
                raise _Denied(refusal.reason)
            addrs = []
            try:
                for a in await self._lookup(hostname, port):
                    a = _normalize(ipaddress.ip_address(a))
                    if a not in addrs:
                        addrs.append(a)
            except (OSError, UnicodeError, ValueError, TypeError) as exc:
                raise _Unreachable(f"cannot resolve {hostname}: {exc}", SOCKS_HOST_UNREACHABLE) from None
            if not addrs:
                raise _Unreachable(f"{hostname} has no addresses", SOCKS_HOST_UNREACHABLE)
        allowed: list[IPAddress] = []
        first_reason: str | None = None
        for addr in addrs:
            decision = self._check_one(hostname, addr, port)
            if decision.allowed:
                allowed.append(addr)
            elif first_reason is None:
                first_reason = decision.reason
        self.destinations.seen(hostname or str(addrs[0]), port, allowed=bool(allowed))
        if not allowed:
            reason = first_reason or "denied"
            self._record_denial(host, port, reason)
            raise _Denied(reason)
        self.allowed_count += 1
        return hostname, allowed

    async def _lookup(self, hostname: str, port: int) -> list[IPAddress]:
        """The resolver's answer for hostname, within the sandbox's lookup budget (see the
        module docstring). A lookup given up on runs on, and counts, until it returns."""
        if len(self._lookups) >= self.max_lookups:
            self.refused_lookups += 1
            if self.refused_lookups == 1:
                log.warning("a sandbox has %d name lookups unanswered: refusing more", self.max_lookups)
            raise _Unreachable(f"not resolved: {self.max_lookups} earlier name lookups of this sandbox "
                               "are still unanswered (try again later)", SOCKS_HOST_UNREACHABLE)
        lookup = asyncio.ensure_future(self._resolve(hostname, port))
        self._lookups.add(lookup)
        lookup.add_done_callback(self._lookup_done)
        done, _ = await asyncio.wait({lookup}, timeout=self.lookup_timeout)
        if not done:
            raise _Unreachable(f"resolving {hostname} timed out", SOCKS_TTL_EXPIRED)
        return lookup.result()

    def _lookup_done(self, lookup: asyncio.Task) -> None:
        self._lookups.discard(lookup)
        if not lookup.cancelled():
            lookup.exception()  # retrieved: a late failure nobody awaits is no error to log

    async def _connect(self, addr: IPAddress, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Open the upstream connection to exactly this (already allowed) address."""
        return await asyncio.wait_for(asyncio.open_connection(str(addr), port), self.connect_timeout)

    async def _connect_any(
        self, addrs: list[IPAddress], port: int
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        last: _Unreachable | None = None
        for addr in addrs:
            where = _hostport(str(addr), port)
            try:
                return await self._connect(addr, port)
            except asyncio.TimeoutError:
                last = _Unreachable(f"connecting to {where} timed out", SOCKS_TTL_EXPIRED)
            except ConnectionRefusedError:
                last = _Unreachable(f"connection to {where} refused", SOCKS_REFUSED)
            except OSError as exc:
                code = {
                    errno.ENETUNREACH: SOCKS_NET_UNREACHABLE,
                    errno.EHOSTUNREACH: SOCKS_HOST_UNREACHABLE,
                    errno.ETIMEDOUT: SOCKS_TTL_EXPIRED,
                    errno.ECONNREFUSED: SOCKS_REFUSED,
                }.get(exc.errno or 0, SOCKS_FAILURE)
                last = _Unreachable(f"cannot connect to {where}: {exc.strerror or exc}", code)
        assert last is not None
        raise last

    # ------------------------------------------------------------------ SOCKS5

    async def _socks5(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> asyncio.StreamWriter | None:
        async def read(n: int) -> bytes:
            return await asyncio.wait_for(reader.readexactly(n), self.handshake_timeout)

        try:
            (nmethods,) = await read(1)
            methods = await read(nmethods) if nmethods else b""
            if 0x00 not in methods:
                writer.write(b"\x05\xff")
                await writer.drain()
                return None
            writer.write(b"\x05\x00")
            await writer.drain()
            ver, cmd, _rsv, atyp = await read(4)
            if ver != 5:
                return None
            if atyp == 0x01:
                host = str(IPv4Address(await read(4)))
            elif atyp == 0x04:
                host = str(_normalize(IPv6Address(await read(16))))
            elif atyp == 0x03:
                (length,) = await read(1)
                raw = await read(length)
                try:
                    host = raw.decode("ascii")
                except UnicodeDecodeError:
                    await self._socks_reply(writer, SOCKS_HOST_UNREACHABLE)
                    return None
            else:
                await self._socks_reply(writer, SOCKS_BAD_ADDRESS_TYPE)
                return None
            port = int.from_bytes(await read(2), "big")
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError):
            return None
        if cmd != 0x01:
            await self._socks_reply(writer, SOCKS_BAD_COMMAND)
            return None
        try:
            up_reader, up_writer = await self._open(host, port)
        except _Denied:
            await self._socks_reply(writer, SOCKS_NOT_ALLOWED)
            return None
        except _Unreachable as exc:
            await self._socks_reply(writer, exc.socks_code)
            return None
        except _BadRequest:
            await self._socks_reply(writer, SOCKS_FAILURE)
            return None
        try:
            bound = up_writer.get_extra_info("sockname") or ("0.0.0.0", 0)
            await self._socks_reply(writer, SOCKS_OK, bound[0], bound[1])
        except Exception:
            await _close(up_writer)
            raise
        await _relay(reader, writer, up_reader, up_writer, self._traffic)
        return up_writer

    @staticmethod
    async def _socks_reply(writer: asyncio.StreamWriter, code: int, host: str = "0.0.0.0", port: int = 0) -> None:
        addr = _parse_ip(str(host).split("%", 1)[0]) or IPv4Address("0.0.0.0")
        atyp = b"\x01" if isinstance(addr, IPv4Address) else b"\x04"
        writer.write(b"\x05" + bytes([code]) + b"\x00" + atyp + addr.packed + int(port).to_bytes(2, "big"))
        with contextlib.suppress(ConnectionError):
            await writer.drain()

    # ------------------------------------------------------------------ HTTP proxy

    async def _read_head(self, first: bytes, reader: asyncio.StreamReader) -> tuple[bytes, bytes] | None:
        """Read up to the blank line; return (head, bytes after it) or None if too big/EOF."""
        buf = bytearray(first)
        while True:
            found = [(i, len(sep)) for sep in (b"\r\n\r\n", b"\n\n") if (i := buf.find(sep)) >= 0]
            if found:
                idx, seplen = min(found)
                if idx + seplen > MAX_HEADER_BYTES:
                    raise _BadRequest("request headers too large")
                return bytes(buf[:idx]), bytes(buf[idx + seplen:])
            if len(buf) > MAX_HEADER_BYTES:
                raise _BadRequest("request headers too large")
            chunk = await reader.read(RELAY_CHUNK)
            if not chunk:
                return None
            buf += chunk

    async def _http(
        self, first: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> asyncio.StreamWriter | None:
        try:
            try:
                got = await asyncio.wait_for(self._read_head(first, reader), self.handshake_timeout)
            except (asyncio.TimeoutError, ConnectionError):
                return None
            if got is None:
                return None
            head, rest = got
            lines = head.decode("latin-1").replace("\r\n", "\n").split("\n")
            parts = lines[0].split(" ")
            if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
                raise _BadRequest("malformed request line")
            method, target, version = parts
            if not re.fullmatch(r"[A-Za-z]+", method):
                raise _BadRequest("malformed request method")
            headers: list[tuple[str, str]] = []
            for line in lines[1:]:
                name, colon, value = line.partition(":")
                if not colon or not name or name != name.strip() or not re.fullmatch(r"[!-~]+", name):
                    raise _BadRequest("malformed header line")
                headers.append((name, value.strip()))
            if method.upper() == "CONNECT":
                host, port = _split_authority(target)
                return await self._http_connect(host, port, rest, reader, writer)
            return await self._http_forward(method, target, version, headers, rest, reader, writer)
        except _BadRequest as exc:
            await _http_error(writer, 400, "Bad Request", f"bad request: {exc}")
            return None

    async def _http_open(
        self, host: str, port: int, writer: asyncio.StreamWriter
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        where = _hostport(host, port)
        try:
            return await self._open(host, port)
        except _Denied as exc:
            await _http_error(writer, 403, "Forbidden", f"egress denied: {where}: {exc.reason}")
        except _Unreachable as exc:
            await _http_error(writer, 502, "Bad Gateway", f"egress failed: {where}: {exc.reason}")
        return None

    async def _http_connect(
        self, host: str, port: int, rest: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> asyncio.StreamWriter | None:
        opened = await self._http_open(host, port, writer)
        if opened is None:
            return None
        up_reader, up_writer = opened
        try:
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await writer.drain()
            if rest:
                self._traffic(True, len(rest))
                up_writer.write(rest)
                await up_writer.drain()
            await _relay(reader, writer, up_reader, up_writer, self._traffic)
        except ConnectionError:
            pass
        return up_writer

    async def _http_forward(
        self,
        method: str,
        target: str,
        version: str,
        headers: list[tuple[str, str]],
        rest: bytes,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> asyncio.StreamWriter | None:
        if not target.lower().startswith("http://"):
            raise _BadRequest("only CONNECT or an absolute http:// URI can be proxied")
        try:
            url = urlsplit(target)
            host = url.hostname or ""
            port = url.port or 80
        except ValueError:
            raise _BadRequest("malformed URI") from None
        if not host or url.username is not None or url.password is not None:
            raise _BadRequest("malformed URI")
        path = url.path or "/"
        if url.query:
            path += "?" + url.query
        opened = await self._http_open(host, port, writer)
        if opened is None:
            return None
        up_reader, up_writer = opened
        try:
            out = [f"{method} {path} {version}"]
            has_host = False
            for name, value in headers:
                lname = name.lower()
                if lname in _DROP_UPSTREAM:
                    continue
                has_host = has_host or lname == "host"
                out.append(f"{name}: {value}")
            if not has_host:
                out.append(f"Host: {url.netloc.rpartition('@')[2]}")
            out.append("Connection: close")
            request = ("\r\n".join(out) + "\r\n\r\n").encode("latin-1") + rest
            self._traffic(True, len(request))
            up_writer.write(request)
            await up_writer.drain()
            await _relay(reader, writer, up_reader, up_writer, self._traffic)
        except ConnectionError:
            pass
        return up_writer


# ---------------------------------------------------------------------- helpers


def _split_authority(target: str) -> tuple[str, int]:
    if target.startswith("["):
        host, bracket, port_s = target[1:].partition("]")
        if not bracket or not port_s.startswith(":") or _parse_ip(host) is None or ":" not in host:
            raise _BadRequest("malformed CONNECT target")
        port_s = port_s[1:]
    else:
        host, colon, port_s = target.rpartition(":")
        if not colon or not host or ":" in host:
            raise _BadRequest("malformed CONNECT target (want host:port)")
    if not port_s.isdigit() or len(port_s) > 5 or not 1 <= int(port_s) <= 65535:
        raise _BadRequest("malformed CONNECT port")
    return host, int(port_s)


async def _http_error(writer: asyncio.StreamWriter, code: int, phrase: str, line: str) -> None:
    body = (line.replace("\r", " ").replace("\n", " ") + "\n").encode("utf-8", "replace")
    writer.write(
        f"HTTP/1.1 {code} {phrase}\r\nContent-Type: text/plain\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode("latin-1") + body
    )
    with contextlib.suppress(ConnectionError):
        await writer.drain()


async def _close(writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(Exception):
        writer.close()
    with contextlib.suppress(Exception, asyncio.TimeoutError):
        await asyncio.wait_for(writer.wait_closed(), 1.0)


async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, count: Callable[[int], None]) -> bool:
    """Copy src to dst until EOF, counting bytes; then half-close dst. Returns whether dst got its EOF."""
    while True:
        chunk = await src.read(RELAY_CHUNK)
        if not chunk:
            break
        count(len(chunk))
        dst.write(chunk)
        await dst.drain()
    if dst.can_write_eof():
        dst.write_eof()
        return True
    return False


async def _relay(
    c_reader: asyncio.StreamReader,
    c_writer: asyncio.StreamWriter,
    u_reader: asyncio.StreamReader,
    u_writer: asyncio.StreamWriter,
    traffic: Callable[[bool, int], None],
) -> None:
    """Relay both ways until both directions hit EOF, or either fails; half-close aware.

    The caller closes both writers afterwards. Both tasks are always finished on return.
    """
    up = asyncio.ensure_future(_pump(c_reader, u_writer, lambda size: traffic(True, size)))
    down = asyncio.ensure_future(_pump(u_reader, c_writer, lambda size: traffic(False, size)))
    with contextlib.suppress(AttributeError):
        up.set_name("egress-relay-up")
        down.set_name("egress-relay-down")
    tasks = {up, down}
    try:
        pending = tasks
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if any(t.cancelled() or t.exception() is not None for t in done):
                break  # one direction broke: tear the whole connection down
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
