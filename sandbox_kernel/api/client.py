"""Async client of the CreateOS Sandbox REST API (and of the local engine, which speaks the same API).

One ``httpx.AsyncClient`` (one connection pool) per :class:`SandboxClient`, and for a managed process's input
and output stream (every cell, acknowledgement and event) connections of its own (kept_connections.py).
Retry policy (createos-api.md §1.4/§15.1):

* GET/HEAD/PUT/DELETE: retried on transport errors (connect, read, timeouts...) and on 408/500/502/503/504;
* POST/PATCH (create, exec, pause, fork...): retried only on 429/503 (the server provably did not process them);
* 429 is retried for every method;
* never retried: streaming exec, file upload, file download, ``/readyz``;
* at most ``max_retries`` retries; backoff ``min(0.5 * 2**n + random() * 0.5, 30)`` s; a ``Retry-After`` header
  (delta-seconds or HTTP-date) replaces the backoff. A ``Retry-After`` longer than ``max_retry_after`` is not
  waited for: the typed error (e.g. :class:`RateLimitError` with ``retry_after``) is raised at once.
"""

from __future__ import annotations

import asyncio
import base64
import gc
import importlib
import json
import random
import urllib.request
from contextlib import asynccontextmanager
from types import ModuleType
from typing import Any, AsyncIterator, Awaitable, Callable, Generic, Mapping, Sequence, TypeVar
from urllib.parse import quote, urlsplit

import httpx
import pybase64

from sandbox_kernel.api.envelope import error_from_response, parse_response, protocol_error, unwrap_page
from sandbox_kernel.api.errors import (
    APITimeoutError,
    APITransportError,
    ProtocolError,
    parse_retry_after,
    redact,
)
from sandbox_kernel.api.kept_connections import KeptConnections
from sandbox_kernel.api.models import (
    CreateProcessRequest,
    CreateSandboxRequest,
    CreateSandboxResponse,
    DestroyResponse,
    EgressDestinations,
    EgressUpdate,
    EgressView,
    ExecFrame,
    ExecRequest,
    ExecResponse,
    FileUploadResponse,
    ForkSandboxRequest,
    Health,
    ManagedProcess,
    PatchSandboxRequest,
    ProcessFrame,
    ProcessInput,
    ProcessInputAck,
    ProcessList,
    ProcessSignal,
    ProcessSignalRequest,
    PtySize,
    Readiness,
    RootfsCatalog,
    SandboxView,
    Shape,
    StatusAck,
    WaitScope,
    WireModel,
)
from sandbox_kernel.api.wire import WireError

from sandbox_kernel import __version__ as _VERSION

__all__ = ["SandboxClient", "ExecStream", "ProcessStream", "BoundedLines", "OversizedLine", "USER_AGENT",
           "PUBLIC_ROUTES", "PAGE_LIMIT", "MAX_FRAME_LINE"]

USER_AGENT = f"sandbox-kernel/{_VERSION}"
#: (method, path) pairs sent without the API key; the local engine answers their paths without one
PUBLIC_ROUTES = frozenset({("GET", "/healthz"), ("GET", "/readyz"), ("GET", "/v1/shapes"), ("GET", "/v1/rootfs")})
#: page size asked for (the server clamps to 500)
PAGE_LIMIT = 500

#: how long a wait_process without timeout_ms may take before the client gives up
UNBOUNDED_WAIT_SECONDS = 24 * 3600.0

_IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS"})
_RETRY_STATUS_IDEMPOTENT = frozenset({408, 429, 500, 502, 503, 504})
_RETRY_STATUS_ANY = frozenset({429, 503})
_SSE_SKIP_PREFIXES = (":", "event:", "id:", "retry:")
_LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})
MAX_PROCESS_URLS = 64  # parsed URLs kept for process calls (see _process_request)

# httpcore receives at most READ_NUM_BYTES (64 KiB) at a time, each read through anyio's
# timeout scope and h11's parser: a process's output stream of 20 MiB took ~500 reads,
# whose overhead was a quarter of the kernel's work on it (such streams go over kept
# connections now, except where a proxy applies; exec streams still come this way). A read
# takes what the socket holds, up to this, and never waits for more: larger reads only make
# fewer of them when the stream is busy. (A class attribute of httpcore's; left alone if it is ever gone.)
_STREAM_READ_BYTES = 256 * 1024


def _widen_httpcore_reads() -> None:
    """Done by a client that uses httpx's own transport (CreateOS): httpcore is imported
    then, and only then (a kernel on the local engine never needs it)."""
    httpcore = _import_httpcore()
    if getattr(httpcore.AsyncHTTP11Connection, "READ_NUM_BYTES", _STREAM_READ_BYTES) < _STREAM_READ_BYTES:
        httpcore.AsyncHTTP11Connection.READ_NUM_BYTES = _STREAM_READ_BYTES


def _import_httpcore() -> ModuleType:
    """httpcore, with the whole of anyio, which it uses on asyncio, imported with the garbage
    collector held off. anyio (4.15 on) finds its names by compiling its own source to an
    AST when first imported, and httpcore's first request imports anyio.abc, in the midst of
    whatever the program does. CPython before 3.11.8 keeps an AST's construction depth in one
    interpreter-wide place: an AST built meanwhile, by a finalizer the collector runs (a
    traceback formatted for a log parses its lines) or by another thread it lets in, makes
    the compile fail with "SystemError: AST constructor recursion depth mismatch", and the
    request with it (it failed the bench in CI). The collector is how both get in."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        importlib.import_module("anyio.abc")  # for its one-time compile, above
        import httpcore
    finally:
        if collecting:
            gc.enable()
    return httpcore


#: longest NDJSON line of an exec or process stream accepted from the service (CreateOS sends small frames; the local
#: engine's are at most about 400 KiB): a longer one is a broken stream, never buffered whole
MAX_FRAME_LINE = 4 * 1024 * 1024
# A process data frame's output field, whose value CreateOS and the local engine write right
# after its key (no space): ProcessStream cuts the value out before parsing the rest.
_DATA_KEY = '"data_base64"'

M = TypeVar("M", bound=WireModel)
F = TypeVar("F", bound=WireModel)


def _backoff(attempt: int) -> float:
    return min(0.5 * (2**attempt) + random.random() * 0.5, 30.0)


def _seg(value: str) -> str:
    """URL-encode one path segment (like encodeURIComponent)."""
    return quote(str(value), safe="")


def _proxied(scheme: str, host: str) -> bool:
    """Whether the environment sends requests to this host through a proxy (as httpx reads
    it: the scheme's or ALL_PROXY, unless NO_PROXY exempts the host)."""
    proxies = urllib.request.getproxies()
    return bool(proxies.get(scheme) or proxies.get("all")) and not urllib.request.proxy_bypass(host)


class BoundedLines:
    """Cuts a stream of text chunks into lines, holding at most ``limit`` characters of an unfinished line.

    What a sandbox writes must never grow its reader without bound (an unterminated line of 300 MiB would
    otherwise be held whole, then copied). ``feed`` returns the lines a chunk completes; a line longer than
    ``limit`` comes back as an :class:`OversizedLine` instead of its text, and its characters are dropped as
    they arrive. A long line (a big image, say) within the limit arrives in many chunks: they are joined once
    at its end, not re-scanned on every chunk.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._parts: list[str] = []  # the unfinished line, while it is within the limit
        self._size = 0  # its length so far (still counted once its text is dropped)

    def feed(self, chunk: str) -> list["str | OversizedLine"]:
        # find, not split: str.split looks at each character (1 ms per MiB here), find uses
        # memchr, and most chunks of a long output hold one newline or none.
        complete: list[str | OversizedLine] = []
        start = 0
        end = chunk.find("\n")
        while end >= 0:
            complete.append(self._finish(chunk[start:end]))
            start = end + 1
            end = chunk.find("\n", start)
        self._take(chunk[start:] if start else chunk)
        return complete

    def close(self) -> "str | OversizedLine":
        """The unfinished last line (``""`` if none), when the stream ends without a final newline."""
        return self._finish("")

    def _take(self, piece: str) -> None:
        self._size += len(piece)
        if self._size > self.limit:
            self._parts = []  # over the limit: count it, keep none of it
        elif piece:
            self._parts.append(piece)

    def _finish(self, piece: str) -> "str | OversizedLine":
        self._take(piece)
        size, line = self._size, "".join(self._parts)
        self._parts, self._size = [], 0
        return OversizedLine(size) if size > self.limit else line


class OversizedLine:
    """Stands for a line longer than the reader's limit; ``size`` is its length in characters."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __repr__(self) -> str:
        return f"OversizedLine({self.size})"


async def _bounded_lines(chunks: AsyncIterator[str], limit: int) -> AsyncIterator["str | OversizedLine"]:
    """The lines of a text stream, bounded as :class:`BoundedLines`; an unfinished last line is yielded too."""
    lines = BoundedLines(limit)
    async for chunk in chunks:
        for line in lines.feed(chunk):
            yield line
    last = lines.close()
    if last:
        yield last


class _FrameStream(Generic[F]):
    """The frames of an NDJSON stream, as they arrive (``async for frame in stream``).

    Iteration ends at EOF only (frames after an exit are delivered). A line that is not a JSON object of the stream's
    frame model raises :class:`ProtocolError` and closes the response; a connection dropped mid-stream raises
    :class:`APITransportError`.
    """

    frame_model: type[F]
    kind: str

    def __init__(self, response: httpx.Response, *, method: str, path: str, secrets: Sequence[str | None]) -> None:
        self.response = response
        self.status_code = response.status_code
        self.request_id = response.headers.get("x-request-id") or response.headers.get("x-fc-request-id")
        self._method = method
        self._path = path
        self._secrets = list(secrets)
        self._started = False

    def __aiter__(self) -> AsyncIterator[F]:
        if self._started:
            raise RuntimeError(f"{self.kind} stream can be iterated only once")
        self._started = True
        return self._frames()

    def _protocol_error(self, message: str) -> ProtocolError:
        return protocol_error(message, self.response, method=self._method, path=self._path, secrets=self._secrets)

    async def _frames(self) -> AsyncIterator[F]:
        try:
            async for raw_line in _bounded_lines(self.response.aiter_text(), MAX_FRAME_LINE):
                if isinstance(raw_line, OversizedLine):
                    await self.response.aclose()
                    raise self._protocol_error(f"stream line longer than {MAX_FRAME_LINE} characters")
                line = raw_line.strip()
                if not line or line.startswith(_SSE_SKIP_PREFIXES):
                    continue
                if line.startswith("data:"):
                    line = line[5:].strip()
                    if not line:
                        continue
                try:
                    frame = self._frame(line)
                except _BadFrame as exc:
                    await self.response.aclose()
                    raise self._protocol_error(str(exc)) from None
                yield frame
        except httpx.TimeoutException as exc:
            raise APITimeoutError(
                f"stream timed out ({type(exc).__name__})", method=self._method, path=self._path
            ) from None
        except httpx.TransportError as exc:
            raise APITransportError(
                f"stream interrupted ({type(exc).__name__}: {redact(str(exc), self._secrets)})",
                method=self._method,
                path=self._path,
            ) from None
        except httpx.StreamError as exc:  # e.g. stream already closed by the caller
            raise APITransportError(
                f"stream unavailable ({type(exc).__name__})", method=self._method, path=self._path
            ) from None

    def _frame(self, line: str) -> F:
        """One line as a frame (_BadFrame if it is not one)."""
        try:
            obj = json.loads(line)
        except ValueError:
            raise _BadFrame(f"stream line is not JSON: {line[:80]!r}") from None
        return self._validate(obj, line)

    def _validate(self, obj: Any, line: str) -> F:
        if not isinstance(obj, dict):
            raise _BadFrame(f"stream line is not a JSON object: {line[:80]!r}")
        try:
            return self.frame_model.from_wire(obj)
        except WireError as exc:
            raise _BadFrame(f"invalid {self.kind} frame: {exc.summary()}") from None


class _BadFrame(Exception):
    """A stream line that is not a frame of its stream's model."""


class ExecStream(_FrameStream[ExecFrame]):
    """The frames of a streaming exec."""

    frame_model = ExecFrame
    kind = "an exec"


class ProcessStream(_FrameStream[ProcessFrame]):
    """The frames of a managed process's ``connect``: replayed output, then live output, then ``exit``."""

    frame_model = ProcessFrame
    kind = "a process"

    def _frame(self, line: str) -> ProcessFrame:
        """A data frame's output is most of its line, and JSON's parser reads it one character
        at a time (0.4 ms per 256 KiB frame here, ~25 ms of the kernel's CPU in a 20 MiB print).
        Here it is cut out, decoded (which checks it) and the rest parsed (0.1 ms), when that
        reads the line exactly as json.loads would; any other line takes the plain path."""
        key = line.find(_DATA_KEY)
        start = key + len(_DATA_KEY) + 2
        end = line.find('"', start)
        # The key must be the line's only one of that name (written as the services write it),
        # or json.loads might keep another. (None can be before the first, nor in a value
        # without quotes: the search starts at its end, not across it, which is slow.)
        if key < 0 or line[start - 2:start] != ':"' or end < 0 or line.find(_DATA_KEY, end) >= 0:
            return super()._frame(line)
        try:
            # Only base64's 65 characters pass: no escape, nor a control character (which
            # JSON forbids), can be in a value that decodes, so it ends at the first quote.
            value = line[start:end]
            data = pybase64.b64decode(value, validate=True)
            obj = json.loads(line[:start] + line[end:])
        except ValueError:
            return super()._frame(line)
        # The rest parses only if the cut was between tokens: `""` left inside a string
        # would close it and open another, which JSON never allows next to a string. And the
        # field must be the frame's own, not one of an object within it.
        if not isinstance(obj, dict) or obj.get("data_base64") != "":
            return super()._frame(line)
        obj["data_base64"] = value
        return self._validate(obj, line).with_data(data)


def _exec_body(
    cmd: str, args: Sequence[str] | None, stdin: str | None, env: Mapping[str, str] | None, stream: bool = False
) -> dict[str, Any]:
    """An exec request as sent: empty stdin, env and args left out, as the SDKs do."""
    request = ExecRequest(cmd=cmd, args=list(args or []), stdin=stdin or None, env=dict(env or {}) or None,
                          stream=stream or None)
    return request.to_wire()


class SandboxClient:
    """Async client of the CreateOS Sandbox REST API.

    Args:
        base_url: e.g. ``https://api.sb.createos.sh`` or ``http://127.0.0.1:8765``. A trailing ``/`` is stripped and
            a path prefix is kept (``https://h/api`` -> ``https://h/api/v1/...``). With ``uds`` it still forms the
            URL (e.g. ``http://localhost``).
        api_key: sent as ``X-Api-Key`` on every route except GET /healthz, /readyz, /v1/shapes, /v1/rootfs. None or
            "" sends no key. Never appears in errors, reprs or logs.
        uds: path of a unix socket to connect to instead of TCP.
        timeout: per-request timeout (s), applied to connect, read, write and pool wait (each idle gap).
        max_retries: retries after the first attempt (see the module docstring for the policy).
        transport: an httpx transport (tests: ``httpx.MockTransport``); overrides ``uds``.
        process_transport: the transport of a managed process's ``input`` and ``connect`` calls (every cell,
            acknowledgement and comm message, and the events that answer them): by default kept connections of
            their own to the same server, see kept_connections.py; with ``transport`` given (and no
            ``process_transport``), or where a proxy applies, ``transport``.
        sleep: awaited between retries (inject a fake in tests).
        max_retry_after: a ``Retry-After`` above this many seconds is not waited for; the error is raised instead.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        uds: str | None = None,
        timeout: float = 60.0,
        max_retries: int = 2,
        transport: httpx.AsyncBaseTransport | None = None,
        process_transport: httpx.AsyncBaseTransport | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        max_retry_after: float = 120.0,
    ) -> None:
        split = urlsplit(base_url)
        if split.scheme not in ("http", "https") or not split.netloc:
            raise ValueError("base_url must be an http(s) URL with a host, e.g. https://api.sb.createos.sh")
        if split.username is not None or split.password is not None or split.query or split.fragment:
            raise ValueError("base_url must not contain credentials, a query or a fragment")
        self._base_url = base_url.rstrip("/")
        self._server = uds or self._base_url  # how errors name the server it failed to reach
        self._prefix = split.path.rstrip("/")
        self._api_key = api_key or None
        self._timeout = float(timeout)
        self._max_retries = max(0, int(max_retries))
        self._sleep = sleep
        self._max_retry_after = float(max_retry_after)
        # Plain http (the local engine, on loopback or a unix socket) never does TLS, and
        # redirects are not followed: skip loading the CA bundle, ~20-40 ms of kernel start.
        tls = split.scheme == "https"
        if transport is None:
            _widen_httpcore_reads()
        if transport is None and uds is not None:
            transport = httpx.AsyncHTTPTransport(uds=uds, verify=tls)
        host = (split.hostname or "").lower()
        trust_env = uds is None and host not in _LOOPBACK_HOSTS
        if process_transport is None and transport is None and not (uds and tls) \
                and not (trust_env and _proxied(split.scheme, host)):
            process_transport = KeptConnections(
                uds=uds, host=host, port=split.port or (443 if tls else 80),
                tls=(lambda: httpx.create_ssl_context(trust_env=trust_env)) if tls else None)
        self._process_transport = process_transport
        self._process_urls: dict[str, httpx.URL] = {}  # by path: each process's URLs, parsed once
        self._http = httpx.AsyncClient(
            transport=transport,
            verify=tls,
            timeout=httpx.Timeout(self._timeout),
            follow_redirects=False,
            # env proxies / netrc must not capture a loopback or unix-socket local engine
            trust_env=trust_env,
            headers={"User-Agent": USER_AGENT, "Accept": "application/json"},
        )

    # ---------------------------------------------------------------------------------------------------- plumbing

    @property
    def base_url(self) -> str:
        return self._base_url

    def __repr__(self) -> str:
        key = "set" if self._api_key else "none"
        return f"SandboxClient(base_url={self._base_url!r}, api_key=<{key}>)"

    async def __aenter__(self) -> "SandboxClient":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()
        if self._process_transport is not None:
            await self._process_transport.aclose()

    @property
    def closed(self) -> bool:
        return self._http.is_closed

    @property
    def _secrets(self) -> list[str | None]:
        return [self._api_key]

    def _headers(self, method: str, path: str, extra: dict[str, str] | None = None) -> dict[str, str]:
        headers: dict[str, str] = {}
        if self._api_key and (method, path) not in PUBLIC_ROUTES:
            headers["X-Api-Key"] = self._api_key
        if extra:
            headers.update(extra)
        return headers

    def _timeout_for(self, timeout: float | None) -> httpx.Timeout:
        return httpx.Timeout(self._timeout if timeout is None else float(timeout))

    def _transport_error(self, exc: Exception, method: str, path: str, attempts: int) -> APITransportError:
        tries = f" after {attempts} attempts" if attempts > 1 else ""
        detail = redact(str(exc), self._secrets) or type(exc).__name__
        if isinstance(exc, httpx.TimeoutException):
            return APITimeoutError(f"timed out{tries} ({type(exc).__name__})", method=method, path=self._prefix + path)
        return APITransportError(  # the URL first: the user must know which server is out of reach
            f"{self._server} ({type(exc).__name__}{tries}: {detail})", method=method, path=self._prefix + path
        )

    def _should_retry_status(self, method: str, status: int) -> bool:
        if status in _RETRY_STATUS_ANY:
            return True
        return method in _IDEMPOTENT and status in _RETRY_STATUS_IDEMPOTENT

    async def _send(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, Any] | None = None,
        json_body: Any = None,
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
        retry: bool = True,
    ) -> httpx.Response:
        """Send one request with the retry policy; returns the (read) final response, whatever its status."""
        url = self._base_url + path
        hdrs = self._headers(method, path, headers)
        attempt = 0
        while True:
            try:
                response = await self._http.request(
                    method,
                    url,
                    params=params,
                    json=json_body,
                    content=content,
                    headers=hdrs,
                    timeout=self._timeout_for(timeout),
                )
            except httpx.TransportError as exc:
                if retry and method in _IDEMPOTENT and attempt < self._max_retries:
                    await self._sleep(_backoff(attempt))
                    attempt += 1
                    continue
                raise self._transport_error(exc, method, path, attempt + 1) from None
            if retry and attempt < self._max_retries and self._should_retry_status(method, response.status_code):
                delay = parse_retry_after(response.headers.get("retry-after"))
                if delay is None:
                    delay = _backoff(attempt)
                elif delay > self._max_retry_after:
                    return response  # not worth waiting: surface the typed error (retry_after set)
                await self._sleep(delay)
                attempt += 1
                continue
            return response

    async def _process_request(self, method: str, path: str, *, json_body: Any = None,
                               params: dict[str, Any] | None = None, timeout: float | None = None,
                               stream: bool = False) -> httpx.Response:
        """A managed process's call over the process transport, around httpx's client (never retried, as no
        input or connect call is); its answer read whole, or with `stream` left for the caller to read."""
        url = self._process_urls.get(path)
        if url is None:  # parsing the URL was half of building an input request
            if len(self._process_urls) >= MAX_PROCESS_URLS:  # the processes of long ago
                self._process_urls.clear()
            url = self._process_urls[path] = httpx.URL(self._base_url + path)
        headers = {"User-Agent": USER_AGENT, "Accept": "application/json", **self._headers(method, path)}
        content = None
        if json_body is not None:
            headers["Content-Type"] = "application/json"
            content = json.dumps(json_body).encode()
        request = httpx.Request(method, url.copy_merge_params(params) if params else url, headers=headers,
                                content=content, extensions={"timeout": self._timeout_for(timeout).as_dict()})
        assert self._process_transport is not None
        try:
            response = await self._process_transport.handle_async_request(request)
            if not stream:
                await response.aread()
        except httpx.TransportError as exc:
            raise self._transport_error(exc, method, path, 1) from None
        return response

    async def _call(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, Any] | None = None,
        json_body: Any = None,
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
        retry: bool = True,
    ) -> Any:
        """Send with retries and return the JSend ``data`` (or raise the typed error)."""
        response = await self._send(
            method,
            path,
            params=params,
            json_body=json_body,
            content=content,
            headers=headers,
            timeout=timeout,
            retry=retry,
        )
        return parse_response(response, method=method, path=self._prefix + path, secrets=self._secrets)

    def _decode(self, model: type[M], data: Any, method: str, path: str) -> M:
        if data is None:
            raise ProtocolError(
                f"empty payload, expected {model.__name__}", method=method, path=self._prefix + path
            )
        try:
            return model.from_wire(data)
        except WireError as exc:
            raise ProtocolError(
                f"invalid {model.__name__}: {exc.summary()}", method=method, path=self._prefix + path
            ) from None

    async def _paginate(self, path: str, model: type[M], params: dict[str, Any] | None = None) -> list[M]:
        items: list[M] = []
        offset = 0
        while True:
            query = dict(params or {})
            query.update(limit=PAGE_LIMIT, offset=offset)
            data = await self._call("GET", path, params=query)
            try:
                page, pagination = unwrap_page(data)
            except ProtocolError as exc:
                raise ProtocolError(exc.message, method="GET", path=self._prefix + path) from None
            items.extend(self._decode(model, item, "GET", path) for item in page)
            count = len(page)
            total = pagination.total if pagination is not None else None
            if count == 0 or total is None:
                return items
            offset += count
            if offset >= total:
                return items

    @staticmethod
    def _sb(sandbox_id: str) -> str:
        if not sandbox_id:
            raise ValueError("sandbox id must not be empty")
        return f"/v1/sandboxes/{_seg(sandbox_id)}"

    # ---------------------------------------------------------------------------------------------- health, catalog

    async def healthz(self) -> Health:
        return self._decode(Health, await self._call("GET", "/healthz"), "GET", "/healthz")

    async def readyz(self) -> Readiness:
        """``{ready, reason?, ...}``: decoded on 200 and on 503 (not ready). Never retried."""
        path = "/readyz"
        response = await self._send("GET", path, retry=False)
        if response.status_code == 503:
            try:
                body = response.json()
            except ValueError:
                body = None
            if isinstance(body, dict) and isinstance(body.get("data"), dict) and "ready" in body["data"]:
                return self._decode(Readiness, body["data"], "GET", path)
        data = parse_response(response, method="GET", path=self._prefix + path, secrets=self._secrets)
        return self._decode(Readiness, data, "GET", path)

    async def shapes(self) -> list[Shape]:
        return await self._paginate("/v1/shapes", Shape)

    async def rootfs(self) -> RootfsCatalog:
        return self._decode(RootfsCatalog, await self._call("GET", "/v1/rootfs"), "GET", "/v1/rootfs")

    # ---------------------------------------------------------------------------------------------------- sandboxes

    async def create_sandbox(
        self, req: CreateSandboxRequest, *, timeout: float | None = None
    ) -> CreateSandboxResponse:
        """``POST /v1/sandboxes``: returns once the sandbox is running. Retried only on 429/503."""
        path = "/v1/sandboxes"
        data = await self._call("POST", path, json_body=req.to_wire(), timeout=timeout)
        return self._decode(CreateSandboxResponse, data, "POST", path)

    async def get_sandbox(self, sandbox_id: str) -> SandboxView:
        path = self._sb(sandbox_id)
        return self._decode(SandboxView, await self._call("GET", path), "GET", path)

    async def list_sandboxes(self, status: str | None = None) -> list[SandboxView]:
        """All sandboxes (every page), optionally filtered by status."""
        params = {"status": str(status)} if status else None
        return await self._paginate("/v1/sandboxes", SandboxView, params)

    async def delete_sandbox(self, sandbox_id: str) -> DestroyResponse:
        path = self._sb(sandbox_id)
        return self._decode(DestroyResponse, await self._call("DELETE", path), "DELETE", path)

    async def patch_sandbox(self, sandbox_id: str, req: PatchSandboxRequest) -> SandboxView:
        path = self._sb(sandbox_id)
        data = await self._call("PATCH", path, json_body=req.to_wire())
        return self._decode(SandboxView, data, "PATCH", path)

    def _view_or_ack(self, data: Any, method: str, path: str) -> SandboxView | StatusAck:
        if isinstance(data, dict) and "created_at" in data:
            return self._decode(SandboxView, data, method, path)
        return self._decode(StatusAck, data, method, path)

    async def pause_sandbox(self, sandbox_id: str) -> SandboxView | StatusAck:
        """``POST .../pause`` (no body). Returns a :class:`SandboxView` when the server sends a full view, else a
        :class:`StatusAck` ``{id, status}`` (early servers). Status is usually ``pausing``: poll until ``paused``."""
        path = self._sb(sandbox_id) + "/pause"
        return self._view_or_ack(await self._call("POST", path), "POST", path)

    async def resume_sandbox(self, sandbox_id: str) -> SandboxView | StatusAck:
        """``POST .../resume`` (no body); like :meth:`pause_sandbox`. Poll until ``running``."""
        path = self._sb(sandbox_id) + "/resume"
        return self._view_or_ack(await self._call("POST", path), "POST", path)

    async def fork_sandbox(self, sandbox_id: str, req: ForkSandboxRequest | None = None) -> SandboxView:
        """``POST .../fork``: the view of the new child. The source must be ``paused`` (else 409)."""
        path = self._sb(sandbox_id) + "/fork"
        body = (req or ForkSandboxRequest()).to_wire()
        return self._decode(SandboxView, await self._call("POST", path, json_body=body), "POST", path)

    async def get_egress(self, sandbox_id: str) -> EgressView:
        path = self._sb(sandbox_id) + "/egress"
        return self._decode(EgressView, await self._call("GET", path), "GET", path)

    async def set_egress(self, sandbox_id: str, egress: Sequence[str] | None) -> EgressView:
        """Replace the whole egress allowlist. ``None`` or ``[]`` = allow all (``None`` is sent as ``[]``, as the
        Python SDK does)."""
        path = self._sb(sandbox_id) + "/egress"
        body = EgressUpdate(egress=list(egress) if egress is not None else []).to_wire()
        return self._decode(EgressView, await self._call("PUT", path, json_body=body), "PUT", path)

    async def egress_destinations(self, sandbox_id: str, clear: bool = False) -> EgressDestinations:
        """Local engine extension (CreateOS has no such route): the destinations the sandbox
        asked its egress proxy for; ``clear`` empties the table (the answer is then empty)."""
        path = self._sb(sandbox_id) + "/egress/destinations"
        method = "DELETE" if clear else "GET"
        return self._decode(EgressDestinations, await self._call(method, path), method, path)

    # --------------------------------------------------------------------------------------------------------- exec

    async def exec(
        self,
        sandbox_id: str,
        cmd: str,
        args: Sequence[str] | None = None,
        *,
        stdin: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> ExecResponse:
        """Buffered exec (no shell: use ``cmd="bash", args=["-lc", script]``). ``stdin`` is the command's whole
        standard input; ``env`` is added to the sandbox's envs for this command. Retried only on 429/503."""
        path = self._sb(sandbox_id) + "/exec"
        body = _exec_body(cmd, args, stdin, env)
        data = await self._call("POST", path, json_body=body, timeout=timeout)
        return self._decode(ExecResponse, data, "POST", path)

    @asynccontextmanager
    async def exec_stream(
        self,
        sandbox_id: str,
        cmd: str,
        args: Sequence[str] | None = None,
        *,
        stdin: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[ExecStream]:
        """Streaming exec: ``async with client.exec_stream(id, "ls") as frames: async for f in frames: ...``

        Frames are yielded as they arrive. Leaving the block closes the response (early exit allowed). A non-2xx
        answer raises the typed error on entry. Never retried. ``timeout`` bounds each idle gap (heartbeats keep a
        healthy stream alive)."""
        path = self._sb(sandbox_id) + "/exec"
        body = _exec_body(cmd, args, stdin, env, stream=True)
        async with self._stream("POST", path, {"stream": "true"}, body, timeout) as response:
            yield ExecStream(response, method="POST", path=self._prefix + path, secrets=self._secrets)

    @asynccontextmanager
    async def _stream(
        self, method: str, path: str, params: dict[str, Any], body: Any, timeout: float | None,
        process_call: bool = False,
    ) -> AsyncIterator[httpx.Response]:
        """A streamed response whose status is 2xx (else the typed error is raised); closed on exit. No retry.
        A managed process's call (`process_call`) goes over the process transport."""
        if process_call and self._process_transport is not None:
            response = await self._process_request(method, path, json_body=body, params=params, timeout=timeout,
                                                   stream=True)
        else:
            request = self._http.build_request(
                method,
                self._base_url + path,
                params=params,
                json=body,
                headers=self._headers(method, path),
                timeout=self._timeout_for(timeout),
            )
            try:
                response = await self._http.send(request, stream=True)
            except httpx.TransportError as exc:
                raise self._transport_error(exc, method, path, 1) from None
        try:
            status = response.status_code
            if not 200 <= status < 300:
                try:
                    await response.aread()
                except httpx.HTTPError as exc:
                    raise self._transport_error(exc, method, path, 1) from None
                if 300 <= status < 400:
                    raise protocol_error(
                        f"unexpected redirect (HTTP {status})", response, method=method, path=self._prefix + path
                    )
                raise error_from_response(response, method=method, path=self._prefix + path, secrets=self._secrets)
            yield response
        finally:
            await response.aclose()

    # --------------------------------------------------------------------------------------------- managed processes

    def _proc(self, sandbox_id: str, process_id: str = "", suffix: str = "") -> str:
        path = self._sb(sandbox_id) + "/processes"
        if process_id:
            path += "/" + _seg(process_id)
        return path + suffix

    async def create_process(self, sandbox_id: str, req: CreateProcessRequest) -> ManagedProcess:
        """``POST .../processes``: start a long-lived process (pipes, or a PTY with ``req.pty``). It outlives every
        connection; only kill, its own exit or the sandbox's end stop it. Retried only on 429/503."""
        path = self._proc(sandbox_id)
        data = await self._call("POST", path, json_body=req.to_wire())
        return self._decode(ManagedProcess, data, "POST", path)

    async def list_processes(self, sandbox_id: str) -> list[ManagedProcess]:
        """Every process of the sandbox's table, exited ones still retained included."""
        path = self._proc(sandbox_id)
        data = await self._call("GET", path)
        return self._decode(ProcessList, data, "GET", path).processes

    async def get_process(self, sandbox_id: str, process_id: str) -> ManagedProcess:
        path = self._proc(sandbox_id, process_id)
        return self._decode(ManagedProcess, await self._call("GET", path), "GET", path)

    async def kill_process(self, sandbox_id: str, process_id: str, *, grace_ms: int = 0) -> ManagedProcess:
        """``DELETE .../processes/:pid``: end the whole tree (SIGTERM, then SIGKILL after ``grace_ms``; at once with
        0). Answers once the tree is gone."""
        path = self._proc(sandbox_id, process_id)
        params = {"grace_ms": int(grace_ms)} if grace_ms > 0 else None
        timeout = self._timeout + grace_ms / 1000
        return self._decode(ManagedProcess, await self._call("DELETE", path, params=params, timeout=timeout),
                            "DELETE", path)

    @asynccontextmanager
    async def connect_process(
        self, sandbox_id: str, process_id: str, *, after: int = 0, timeout: float | None = None
    ) -> AsyncIterator[ProcessStream]:
        """``GET .../processes/:pid/connect?after=N``: the retained frames with ``seq > after``, then live ones,
        then ``exit``. Leaving the block disconnects (the process runs on). Never retried: reconnect with the
        last ``seq`` seen. ``timeout`` bounds each idle gap (heartbeats keep an idle stream alive)."""
        path = self._proc(sandbox_id, process_id, "/connect")
        async with self._stream("GET", path, {"after": int(after)}, None, timeout, process_call=True) as response:
            yield ProcessStream(response, method="GET", path=self._prefix + path, secrets=self._secrets)

    async def prepare_process_calls(self) -> None:
        """Open the process transport's connection for the coming calls ahead of them, where
        opening one costs handshakes (a TCP server: CreateOS's TLS); best effort."""
        if isinstance(self._process_transport, KeptConnections):
            await self._process_transport.prepare(self._timeout)

    async def process_input(self, sandbox_id: str, process_id: str, data: bytes) -> int:
        """Write ``data`` to the process's stdin (a PTY: as keystrokes); its ``input_seq``. Never retried (a
        retry could write twice)."""
        path = self._proc(sandbox_id, process_id, "/input")
        body = ProcessInput(data_base64=base64.b64encode(data).decode()).to_wire()
        if self._process_transport is None:
            ack = await self._call("POST", path, json_body=body, retry=False)
        else:
            ack = parse_response(await self._process_request("POST", path, json_body=body), method="POST",
                                 path=self._prefix + path, secrets=self._secrets)
        return self._decode(ProcessInputAck, ack, "POST", path).input_seq

    async def close_process_stdin(self, sandbox_id: str, process_id: str) -> None:
        """The process reads EOF once it has read what was written (pipe processes only)."""
        await self._call("POST", self._proc(sandbox_id, process_id, "/stdin/close"))

    async def resize_process(self, sandbox_id: str, process_id: str, rows: int, cols: int) -> None:
        """Set a PTY's size (its foreground job gets SIGWINCH)."""
        body = PtySize(rows=rows, cols=cols).to_wire()
        await self._call("POST", self._proc(sandbox_id, process_id, "/resize"), json_body=body)

    async def signal_process(self, sandbox_id: str, process_id: str, signal: ProcessSignal | str) -> None:
        """Send ``signal`` to the process's group (a PTY: to its foreground job, as the terminal's keys would)."""
        body = ProcessSignalRequest(signal=ProcessSignal(signal)).to_wire()
        await self._call("POST", self._proc(sandbox_id, process_id, "/signal"), json_body=body)

    async def wait_process(
        self,
        sandbox_id: str,
        process_id: str,
        *,
        scope: WaitScope | str = WaitScope.LEADER,
        timeout_ms: int | None = None,
    ) -> ManagedProcess:
        """Long-poll until the leader (or with ``scope="tree"`` its whole tree) has exited, or ``timeout_ms`` ran
        out: the process as it then is (check ``leader_exited`` / ``tree_exited``)."""
        path = self._proc(sandbox_id, process_id, "/wait")
        params: dict[str, Any] = {"scope": WaitScope(scope).value}
        if timeout_ms is not None:
            params["timeout_ms"] = int(timeout_ms)
        # The answer comes when the wait ends: allow for it (an unbounded wait: a day) plus the usual timeout.
        waited = UNBOUNDED_WAIT_SECONDS if timeout_ms is None else timeout_ms / 1000
        data = await self._call("GET", path, params=params, timeout=self._timeout + waited)
        return self._decode(ManagedProcess, data, "GET", path)

    # -------------------------------------------------------------------------------------------------------- files

    async def upload_file(
        self, sandbox_id: str, path: str, data: bytes, *, timeout: float | None = None
    ) -> FileUploadResponse:
        """``PUT .../files?path=<abs>`` with the raw bytes. Never retried."""
        route = self._sb(sandbox_id) + "/files"
        payload = await self._call(
            "PUT",
            route,
            params={"path": path},
            content=bytes(data),
            headers={"Content-Type": "application/octet-stream"},
            timeout=timeout,
            retry=False,
        )
        if payload is None:
            return FileUploadResponse()
        return self._decode(FileUploadResponse, payload, "PUT", route)

    async def download_file(self, sandbox_id: str, path: str, *, timeout: float | None = None) -> bytes:
        """``GET .../files?path=<abs>``: the raw bytes on 200 (JSend error otherwise), held whole: for files
        of a known, small size; :meth:`download_stream` bounds what it holds. Never retried."""
        async with self.download_stream(sandbox_id, path, timeout=timeout) as chunks:
            return b"".join([chunk async for chunk in chunks])

    @asynccontextmanager
    async def download_stream(
        self, sandbox_id: str, path: str, *, timeout: float | None = None
    ) -> AsyncIterator[AsyncIterator[bytes]]:
        """``GET .../files?path=<abs>``, its body as it arrives: ``async with client.download_stream(id, path) as
        chunks: async for chunk in chunks: ...``, so the caller counts and bounds what it takes (the announced
        size is the server's word). JSend error on a failure status. Never retried."""
        route = self._sb(sandbox_id) + "/files"
        async with self._stream("GET", route, {"path": path}, None, timeout) as response:
            if response.status_code != 200:
                raise protocol_error(f"unexpected HTTP {response.status_code} for a download", response,
                                     method="GET", path=self._prefix + route)
            yield self._body_chunks(response, route)

    async def _body_chunks(self, response: httpx.Response, route: str) -> AsyncIterator[bytes]:
        try:
            async for chunk in response.aiter_bytes():
                yield chunk
        except httpx.TransportError as exc:
            raise self._transport_error(exc, "GET", route, 1) from None
