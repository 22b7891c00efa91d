"""The local engine's HTTP face: CreateOS routes, envelopes and auth over an Engine.

Every route answers exactly as createos-api.md describes CreateOS: JSend envelopes,
paginated lists, raw bytes for file downloads, NDJSON for streaming exec with a
heartbeat every 5 s, and the `X-Api-Key` header on every route except the public ones.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import Body, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sandbox_kernel.api import PUBLIC_ROUTES, envelope
from sandbox_kernel.api.models import (
    BandwidthRecharge,
    BandwidthView,
    CreateProcessRequest,
    CreateSandboxRequest,
    CreateSandboxResponse,
    DestroyResponse,
    EgressDenial,
    EgressDestination,
    EgressDestinations,
    EgressUpdate,
    EgressView,
    ExecRequest,
    ExecResponse,
    ExecResult,
    FileUploadResponse,
    ForkSandboxRequest,
    Health,
    HostPublic,
    ManagedProcess,
    PatchSandboxRequest,
    ProcessAck,
    ProcessInput,
    ProcessInputAck,
    ProcessList,
    ProcessSignalRequest,
    PtySize,
    Readiness,
    WaitScope,
)
from sandbox_kernel.local.access_tokens import (
    SANDBOX_ROUTE,
    AccessToken,
    AccessTokenCreated,
    AccessTokenMetadata,
    token_may_use,
)
from sandbox_kernel.local import processes
from sandbox_kernel.local.agent_client import AgentUnavailable
from sandbox_kernel.local.catalog import CATALOG
from sandbox_kernel.local.egress_destinations import DestinationLog
from sandbox_kernel.api.shapes import SHAPES
from sandbox_kernel.local.engine import ANSWER_FORKED_WITHIN, HEARTBEAT_SECONDS, Engine
from sandbox_kernel.local.engine_errors import EngineError
from sandbox_kernel.local.local_sandbox import LocalSandbox, rfc3339
from sandbox_kernel.local.unsupported import add_unsupported_routes

log = logging.getLogger("sandbox_kernel.server")

# Answered without a key, whatever the method (a HEAD too): the paths of the API's public routes.
PUBLIC_PATHS = frozenset(path for _method, path in PUBLIC_ROUTES)
PROCESS_INPUT_ROUTE = re.compile(r"/v1/sandboxes/([^/]+)/processes/([^/]+)/input")  # as FastAPI matches it
# A buffered exec returns at most this many characters of output (stdout and stderr
# together; JSON escaping can make the response up to six times that). Past it, output
# is discarded while the command runs to its end, and `error` says how much was cut.
MAX_BUFFERED_OUTPUT = 8 * 1024 * 1024
STREAM_BACKLOG = 16  # exec frames (64 KiB of output each at most) waiting for a slow client
MAX_PAGE = 500
DEFAULT_PAGE = 50
MAX_WAIT_MS = 3_600_000  # the longest kill grace the engine accepts (an hour)
UNMETERED = -1  # CreateOS's quota_bytes for a sandbox without a bandwidth quota


def jsend(data: Any, status: int = 200) -> JSONResponse:
    return JSONResponse(envelope.success(data), status_code=status)


def jsend_fail(status: int, message: str, code: str | None = None) -> JSONResponse:
    data: dict[str, Any] = {"message": message}
    if code:
        data["code"] = code
    return JSONResponse(envelope.fail(data), status_code=status)


def page(items: list[Any], limit: int, offset: int) -> JSONResponse:
    limit = max(1, min(limit, MAX_PAGE))
    offset = max(0, offset)
    return jsend(envelope.paginated(items[offset:offset + limit], total=len(items),
                                    limit=limit, offset=offset))


class Authenticate:
    """Checks the key of every request but the public ones, counts it as activity, and tags
    the answer with an X-Request-Id. Plain ASGI: Starlette's BaseHTTPMiddleware passes
    every answer, each chunk of a process's output stream too, through a task and a memory
    stream of its own (about a millisecond per request, the costliest step of a cell's
    round trip on the engine)."""

    def __init__(self, app: ASGIApp, engine: Engine, token: str) -> None:
        self.app = app
        self.engine = engine
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = uuid.uuid4().hex
        path = scope["path"]
        refusal = None if path in PUBLIC_PATHS else refuse_key(
            self.engine, self.token, offered_credential(Request(scope)), path)
        if refusal is not None:
            refusal.headers["X-Request-Id"] = request_id
            await refusal(scope, receive, send)
            return
        if path not in PUBLIC_PATHS:
            self.engine.touch()
        started = False

        async def send_tagged(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                MutableHeaders(scope=message).append("X-Request-Id", request_id)
            await send(message)

        try:
            await self.app(scope, receive, send_tagged)
        except Exception:  # answered here: re-raised past this point, it would close the connection
            log.exception("internal error")
            if started:  # part of an answer is out: the server ends it
                return
            response = JSONResponse(envelope.error("internal error", 500), status_code=500)
            response.headers["X-Request-Id"] = request_id
            await response(scope, receive, send)


class ProcessInputShortcut:
    """Answers a managed process's `input` call without FastAPI's routing and parameter
    machinery, which took about half of the engine's CPU for the call (py-spy): a cell's
    request is one such call, as is each acknowledgement and comm message.

    Only a call the route would take goes this way: a JSON body that is a ProcessInput.
    Any other goes on to the app, whose route answers it, so its errors are the route's;
    what the write itself raises is answered by the app's own exception handlers. Inside
    Authenticate, so the key check, activity and X-Request-Id are as for every route."""

    def __init__(self, app: ASGIApp, engine: Engine, handlers: dict[Any, Any]) -> None:
        self.app = app
        self.engine = engine
        self.handlers = handlers  # the app's, filled as create_app declares them

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = (PROCESS_INPUT_ROUTE.fullmatch(scope["path"])
                 if scope["type"] == "http" and scope["method"] == "POST" else None)
        if route is None or _media_type(scope) != b"application/json":
            await self.app(scope, receive, send)
            return
        body = await _request_body(receive)
        if body is None:
            return  # the client went away
        try:
            request = ProcessInput.from_wire(json.loads(body))
        except (ValueError, RecursionError):  # not JSON (or nested too deep), or not an input:
            # FastAPI's validation answers it
            await self.app(scope, _replaying(body, receive), send)
            return
        try:
            response = await write_process_input(self.engine, route[1], route[2], request)
        except Exception as exc:
            handler = next((self.handlers[kind] for kind in type(exc).__mro__ if kind in self.handlers), None)
            if handler is None:
                raise
            response = await handler(Request(scope), exc)
        await response(scope, receive, send)


def _media_type(scope: Scope) -> bytes:
    value = next((value for name, value in scope["headers"] if name == b"content-type"), b"")
    return value.split(b";", 1)[0].strip().lower()


async def _request_body(receive: Receive) -> bytes | None:
    """The whole body (as FastAPI reads it for a JSON body), or None if the client left."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


def _replaying(body: bytes, receive: Receive) -> Receive:
    """`receive` for an app after the body was read: the body again, then what comes."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if replayed:
            return await receive()
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}
    return replay


async def write_process_input(engine: Engine, sandbox_id: str, process_id: str,
                              body: ProcessInput) -> JSONResponse:
    try:
        data = base64.b64decode(body.data_base64, validate=True)
    except ValueError:
        raise EngineError("data_base64 is not valid base64", code="invalid_base64") from None
    return jsend(ProcessInputAck(**await processes.write_input(engine, sandbox_id, process_id, data)))


def create_app(engine: Engine, token: str) -> FastAPI:
    app = FastAPI(title="sandbox-kernel local engine (CreateOS-compatible)", version="1")
    app.state.engine = engine

    app.add_middleware(ProcessInputShortcut, engine=engine, handlers=app.exception_handlers)
    app.add_middleware(Authenticate, engine=engine, token=token)  # added last: the outer one

    @app.exception_handler(EngineError)
    async def engine_error(_: Request, exc: EngineError) -> JSONResponse:
        if exc.status >= 500:  # JSend: "error" for the server's failures, "fail" for the client's
            return JSONResponse(envelope.error(str(exc), exc.status), status_code=exc.status)
        return jsend_fail(exc.status, str(exc), exc.code)

    @app.exception_handler(AgentUnavailable)
    async def agent_unavailable(_: Request, exc: AgentUnavailable) -> JSONResponse:
        return JSONResponse(envelope.error("sandbox agent is not reachable", 502), status_code=502)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(err["type"] == "json_invalid" for err in errors):
            return jsend_fail(400, "request body is not valid JSON", "invalid_json")
        fields = {".".join(str(p) for p in err["loc"][1:]) or "body": err["msg"] for err in errors}
        return JSONResponse(envelope.fail({**fields, "code": "validation"}), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        codes = {404: "route_not_found", 405: "method_not_allowed"}
        return jsend_fail(exc.status_code, str(exc.detail), codes.get(exc.status_code))

    @app.exception_handler(Exception)
    async def internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")
        return JSONResponse(envelope.error("internal error", 500), status_code=500)

    # -- health and catalog (no key) ---------------------------------------------------

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        return jsend(Health(up=True))

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        return jsend(Readiness(ready=True))

    @app.get("/v1/shapes")
    async def shapes(limit: int = DEFAULT_PAGE, offset: int = 0) -> JSONResponse:
        return page(SHAPES, limit, offset)

    @app.get("/v1/rootfs")
    async def rootfs() -> JSONResponse:
        return jsend(CATALOG)

    @app.get("/v1/whoami")
    async def whoami() -> JSONResponse:
        live = engine.list()
        running = sum(1 for sb in live if sb.status.value == "running")
        paused = sum(1 for sb in live if sb.status.value == "paused")
        return jsend({"user_id": "local", "stats": {
            "running": running, "paused": paused, "other": len(live) - running - paused,
            "total": len(live)}, "engine": {"freezer": engine.freezer.describe()}})

    # -- sandboxes ---------------------------------------------------------------------

    @app.post("/v1/sandboxes")
    async def create_sandbox(body: Annotated[CreateSandboxRequest, Body()]) -> JSONResponse:
        sandbox = await engine.create(body)
        view = sandbox.view()
        return jsend(CreateSandboxResponse.from_wire(view.to_wire()))

    @app.get("/v1/sandboxes")
    async def list_sandboxes(status: str | None = None, limit: int = DEFAULT_PAGE,
                             offset: int = 0) -> JSONResponse:
        return page([sb.view() for sb in engine.list(status)], limit, offset)

    @app.get("/v1/sandboxes/{sandbox_id}")
    async def get_sandbox(sandbox_id: str) -> JSONResponse:
        return jsend(engine.get(sandbox_id).view())

    @app.delete("/v1/sandboxes/{sandbox_id}")
    async def destroy_sandbox(sandbox_id: str) -> JSONResponse:
        sandbox = await engine.destroy(sandbox_id)
        return jsend(DestroyResponse(id=sandbox.id, status=sandbox.status))

    @app.patch("/v1/sandboxes/{sandbox_id}")
    async def patch_sandbox(sandbox_id: str, body: Annotated[PatchSandboxRequest, Body()]) -> JSONResponse:
        return jsend(engine.patch(sandbox_id, body).view())

    # Asynchronous like CreateOS: answer `paused`/`running` if that is done within a moment
    # (Engine.settled_soon), else `pausing`/`resuming`; poll GET for the result.
    @app.post("/v1/sandboxes/{sandbox_id}/pause")
    async def pause_sandbox(sandbox_id: str) -> JSONResponse:
        return jsend((await engine.settled_soon(engine.pause(sandbox_id))).view())

    @app.post("/v1/sandboxes/{sandbox_id}/resume")
    async def resume_sandbox(sandbox_id: str) -> JSONResponse:
        return jsend((await engine.settled_soon(engine.resume(sandbox_id))).view())

    # One child per call, answered once made (`running`, or `paused` if asked) if that takes
    # under ANSWER_FORKED_WITHIN, else in `forking`; the source must be paused and stays so.
    @app.post("/v1/sandboxes/{sandbox_id}/fork")
    async def fork_sandbox(sandbox_id: str,
                           body: Annotated[ForkSandboxRequest | None, Body()] = None) -> JSONResponse:
        child = engine.fork(sandbox_id, body or ForkSandboxRequest())
        return jsend((await engine.settled_soon(child, ANSWER_FORKED_WITHIN)).view())

    # -- egress --------------------------------------------------------------------------

    @app.get("/v1/sandboxes/{sandbox_id}/egress")
    async def get_egress(sandbox_id: str) -> JSONResponse:
        return jsend(egress_view(engine.get(sandbox_id)))

    @app.put("/v1/sandboxes/{sandbox_id}/egress")
    async def put_egress(sandbox_id: str, body: Annotated[EgressUpdate, Body()]) -> JSONResponse:
        return jsend(egress_view(engine.set_egress(sandbox_id, body.egress)))

    # Local engine extension: the destinations the sandbox asked for (`%egress learn`).
    @app.get("/v1/sandboxes/{sandbox_id}/egress/destinations")
    async def get_egress_destinations(sandbox_id: str) -> JSONResponse:
        return jsend(destinations_view(engine.get(sandbox_id)))

    @app.delete("/v1/sandboxes/{sandbox_id}/egress/destinations")
    async def clear_egress_destinations(sandbox_id: str) -> JSONResponse:
        sandbox = engine.get(sandbox_id)
        if sandbox.gate:
            sandbox.gate.proxy.destinations.clear()
        return jsend(destinations_view(sandbox))

    # -- bandwidth (counted by the egress proxy; never metered locally) ---------------------

    @app.get("/v1/sandboxes/{sandbox_id}/bandwidth")
    async def bandwidth(sandbox_id: str) -> JSONResponse:
        return jsend(bandwidth_view(engine.get(sandbox_id)))

    @app.post("/v1/sandboxes/{sandbox_id}/bandwidth/recharge")
    async def recharge_bandwidth(sandbox_id: str, body: Annotated[BandwidthRecharge, Body()]) -> JSONResponse:
        return jsend(bandwidth_view(engine.get(sandbox_id)))  # a no-op when unmetered (§7)

    # -- per-sandbox access tokens (§15.4) -------------------------------------------------

    @app.post("/v1/sandboxes/{sandbox_id}/access-token")
    async def create_access_token(sandbox_id: str) -> JSONResponse:
        return jsend(token_created(*engine.create_access_token(sandbox_id)))

    @app.post("/v1/sandboxes/{sandbox_id}/access-token/rotate")
    async def rotate_access_token(sandbox_id: str) -> JSONResponse:
        return jsend(token_created(*engine.rotate_access_token(sandbox_id)))

    @app.get("/v1/sandboxes/{sandbox_id}/access-token")
    async def get_access_token(sandbox_id: str) -> JSONResponse:
        return jsend(token_metadata(engine.get(sandbox_id).access_token))

    @app.delete("/v1/sandboxes/{sandbox_id}/access-token")
    async def disable_access_token(sandbox_id: str) -> JSONResponse:
        return jsend(token_metadata(engine.disable_access_token(sandbox_id)))

    # -- exec ----------------------------------------------------------------------------

    @app.post("/v1/sandboxes/{sandbox_id}/exec")
    async def exec_command(sandbox_id: str, body: Annotated[ExecRequest, Body()],
                           stream: bool = Query(False)) -> Response:
        engine.check_exec(sandbox_id, body.cmd, body.args, body.env)  # 400/404/409 before any stream starts
        if stream or body.stream:
            return StreamingResponse(exec_stream(engine, sandbox_id, body),
                                     media_type="application/x-ndjson")
        started = time.monotonic()
        result = await buffered_exec(engine, sandbox_id, body)
        return jsend(ExecResponse(result=result, exec_ms=(time.monotonic() - started) * 1000))

    # -- managed processes (processes.py) ----------------------------------------------

    @app.post("/v1/sandboxes/{sandbox_id}/processes")
    async def create_process(sandbox_id: str, body: Annotated[CreateProcessRequest, Body()]) -> JSONResponse:
        request = body.to_wire()
        request["env"] = {**engine.get(sandbox_id).envs, **(body.env or {})}
        return jsend(ManagedProcess(**await processes.call(engine, sandbox_id, "create", **request)))

    @app.get("/v1/sandboxes/{sandbox_id}/processes")
    async def list_processes(sandbox_id: str) -> JSONResponse:
        return jsend(ProcessList(**await processes.call(engine, sandbox_id, "list")))

    @app.get("/v1/sandboxes/{sandbox_id}/processes/{process_id}")
    async def get_process(sandbox_id: str, process_id: str) -> JSONResponse:
        return jsend(ManagedProcess(**await processes.call(engine, sandbox_id, "get", id=process_id)))

    @app.delete("/v1/sandboxes/{sandbox_id}/processes/{process_id}")
    async def kill_process(sandbox_id: str, process_id: str,
                           grace_ms: int = Query(0, ge=0, le=MAX_WAIT_MS)) -> JSONResponse:
        reply = await processes.call(engine, sandbox_id, "kill", id=process_id, grace_ms=grace_ms)
        return jsend(ManagedProcess(**reply))

    @app.get("/v1/sandboxes/{sandbox_id}/processes/{process_id}/connect")
    async def connect_process(sandbox_id: str, process_id: str,
                              after: int = Query(0, ge=0)) -> StreamingResponse:
        frames = await processes.connect(engine, sandbox_id, process_id, after)
        return StreamingResponse(frames, media_type="application/x-ndjson")

    @app.post("/v1/sandboxes/{sandbox_id}/processes/{process_id}/input")
    async def process_input(sandbox_id: str, process_id: str,
                            body: Annotated[ProcessInput, Body()]) -> JSONResponse:
        # Taken by ProcessInputShortcut unless malformed: this answers the rest, as it did all.
        return await write_process_input(engine, sandbox_id, process_id, body)

    @app.post("/v1/sandboxes/{sandbox_id}/processes/{process_id}/stdin/close")
    async def close_process_stdin(sandbox_id: str, process_id: str) -> JSONResponse:
        await processes.close_stdin(engine, sandbox_id, process_id)
        return jsend(ProcessAck())

    @app.post("/v1/sandboxes/{sandbox_id}/processes/{process_id}/resize")
    async def resize_process(sandbox_id: str, process_id: str, body: Annotated[PtySize, Body()]) -> JSONResponse:
        await processes.call(engine, sandbox_id, "resize", id=process_id, rows=body.rows, cols=body.cols)
        return jsend(ProcessAck())

    @app.post("/v1/sandboxes/{sandbox_id}/processes/{process_id}/signal")
    async def signal_process(sandbox_id: str, process_id: str,
                             body: Annotated[ProcessSignalRequest, Body()]) -> JSONResponse:
        await processes.call(engine, sandbox_id, "signal", id=process_id, signal=body.signal.value)
        return jsend(ProcessAck())

    @app.get("/v1/sandboxes/{sandbox_id}/processes/{process_id}/wait")
    async def wait_process(sandbox_id: str, process_id: str, scope: WaitScope = WaitScope.LEADER,
                           timeout_ms: int | None = Query(None, ge=0)) -> JSONResponse:
        reply = await processes.call(engine, sandbox_id, "wait", id=process_id, scope=scope.value,
                                     timeout_ms=timeout_ms)
        return jsend(ManagedProcess(**reply))

    # -- files: streamed both ways, never held whole ------------------------------------

    @app.put("/v1/sandboxes/{sandbox_id}/files")
    async def upload(sandbox_id: str, request: Request, path: str = Query(...)) -> JSONResponse:
        require_absolute(path)
        length = request.headers.get("content-length", "")
        written = await engine.write_file(sandbox_id, path, request.stream(),
                                          int(length) if length.isdigit() else None)
        return jsend(FileUploadResponse(bytes=written, path=path))

    @app.get("/v1/sandboxes/{sandbox_id}/files")
    async def download(sandbox_id: str, path: str = Query(...)) -> Response:
        require_absolute(path)
        held = contextlib.AsyncExitStack()
        size, chunks = await held.enter_async_context(engine.read_file(sandbox_id, path))
        return StreamingResponse(closing_after(chunks, held), media_type="application/octet-stream",
                                 headers={"Content-Length": str(size)})

    # -- hosts: the local engine is one host ---------------------------------------------

    @app.get("/v1/hosts")
    async def hosts(limit: int = DEFAULT_PAGE, offset: int = 0) -> JSONResponse:
        return page([local_host(engine)], limit, offset)

    add_unsupported_routes(app, engine)
    return app


async def buffered_exec(engine: Engine, sandbox_id: str, body: ExecRequest) -> ExecResult:
    """Run a command to its end and collect its output, up to MAX_BUFFERED_OUTPUT."""
    result = ExecResult(exit_code=-1)
    output: dict[str, list[str]] = {"stdout": [], "stderr": []}  # joined once: += is quadratic
    kept = cut = 0
    async for frame in engine.exec(sandbox_id, body.cmd, body.args, body.stdin or "", body.env):
        for name, parts in output.items():
            text = frame.get(name, "")
            room = max(0, MAX_BUFFERED_OUTPUT - kept)
            if text and room:
                parts.append(text[:room])
            kept += min(len(text), room)
            cut += max(0, len(text) - room)
        if "error" in frame:
            result.error = frame["error"]
        if "exit_code" in frame:
            result.exit_code = frame["exit_code"]
    result.stdout, result.stderr = "".join(output["stdout"]), "".join(output["stderr"])
    if cut:
        result.error = (f"output truncated: a buffered exec returns at most {MAX_BUFFERED_OUTPUT // 2**20} MiB "
                        f"of output, {cut} more characters were discarded (a streaming exec returns all)")
    return result


async def closing_after(chunks: AsyncIterator[bytes], held: contextlib.AsyncExitStack) -> AsyncIterator[bytes]:
    async with held:
        async for chunk in chunks:
            yield chunk


# CreateOS reads these before X-Api-Key (§1), so a stale one shadows a good key there: the
# same here, so a client that would fail on CreateOS fails locally too.
SHADOWING_HEADERS = ("x-auth-token", "x-access-token", "authorization")


def offered_credential(request: Request) -> str:
    for name in SHADOWING_HEADERS:
        if name in request.headers:
            value = request.headers[name]
            return value.removeprefix("Bearer ") if name == "authorization" else value
    return request.headers.get("x-api-key", "")


def refuse_key(engine: Engine, token: str, offered: str, path: str) -> Response | None:
    """None if `offered` may call `path`: the engine's key anywhere, a sandbox's access
    token on its own sandbox's routes only; else the refusal to send."""
    if hmac.compare_digest(offered.encode(), token.encode()):
        return None
    bound = engine.sandbox_for_token(offered) if offered else None
    if bound is None:
        return jsend_fail(401, "missing or invalid API key", "unauthorized")
    if token_may_use(path, bound):
        return None
    route = SANDBOX_ROUTE.match(path)
    if route and route["id"] != bound:
        return jsend_fail(404, "sandbox not found", "sandbox_not_found")  # as for another owner's
    return jsend_fail(403, "a sandbox access token can only operate its own sandbox",
                      "access_token_scope")


def token_created(access_token: AccessToken, plaintext: str) -> AccessTokenCreated:
    return AccessTokenCreated(
        token=plaintext, enabled=access_token.enabled, created_at=rfc3339(access_token.created_at),
        rotated_at=rfc3339(access_token.rotated_at) if access_token.rotated_at else None)


def token_metadata(access_token: AccessToken | None) -> AccessTokenMetadata:
    if access_token is None:
        return AccessTokenMetadata(enabled=False)
    return AccessTokenMetadata(
        enabled=access_token.enabled, token_hint=access_token.hint if access_token.enabled else None,
        created_at=rfc3339(access_token.created_at),
        rotated_at=rfc3339(access_token.rotated_at) if access_token.rotated_at else None)


def bandwidth_view(sandbox: LocalSandbox) -> BandwidthView:
    proxy = sandbox.gate.proxy if sandbox.gate else None
    return BandwidthView(id=sandbox.id, quota_bytes=UNMETERED, remaining_bytes=UNMETERED,
                         used_bytes=proxy.bytes_out if proxy else 0,
                         ingress_bytes=proxy.bytes_in if proxy else 0, capped=False)


def local_host(engine: Engine) -> HostPublic:
    with open("/proc/meminfo") as meminfo:
        available = next((int(line.split()[1]) // 1024 for line in meminfo
                          if line.startswith("MemAvailable:")), 0)
    return HostPublic(id="local", status="active", free_mib=available, vm_count=engine.live_count,
                      rootfses=CATALOG.rootfs)


def egress_view(sandbox: LocalSandbox) -> EgressView:
    proxy = sandbox.gate.proxy if sandbox.gate else None
    return EgressView(
        id=sandbox.id, egress=list(sandbox.egress),
        denied_count=proxy.denied_count if proxy else 0,
        denied=[EgressDenial(at=rfc3339(d.at), host=d.host, port=d.port, reason=d.reason)
                for d in (proxy.denials if proxy else ())])


def destinations_view(sandbox: LocalSandbox) -> EgressDestinations:
    log = sandbox.gate.proxy.destinations if sandbox.gate else DestinationLog()
    return EgressDestinations(
        id=sandbox.id, cap=log.cap, dropped=log.dropped,
        destinations=[EgressDestination(host=host, port=port, allowed=reached.allowed, refused=reached.refused)
                      for (host, port), reached in log.table.items()])


def require_absolute(path: str) -> None:
    if not path.startswith("/"):
        raise EngineError(f"path must be absolute: {path!r}", code="relative_path")


async def exec_stream(engine: Engine, sandbox_id: str, body: ExecRequest) -> AsyncIterator[bytes]:
    """NDJSON frames of one command, with {"hb": true} when nothing else was sent for 5 s.

    When the client goes away, Starlette closes this generator; the pump task is then
    cancelled, which closes the agent connection, which kills the command.
    """
    # Bounded: a client slower than the command holds the command back (through the
    # agent's pipe), instead of the engine holding its output.
    frames: asyncio.Queue[dict | None] = asyncio.Queue(maxsize=STREAM_BACKLOG)

    async def pump() -> None:
        try:
            async for frame in engine.exec(sandbox_id, body.cmd, body.args, body.stdin or "", body.env):
                await frames.put(frame)
        except EngineError as cut:  # as CreateOS ends a stream: an error frame, then the exit
            await frames.put({"error": str(cut)})
            await frames.put({"exit_code": -1})
        finally:
            await frames.put(None)

    task = asyncio.get_running_loop().create_task(pump())
    try:
        while True:
            try:
                frame = await asyncio.wait_for(frames.get(), HEARTBEAT_SECONDS)
            except asyncio.TimeoutError:
                frame = {"hb": True}
            if frame is None:
                return
            yield (json.dumps(frame, separators=(",", ":")) + "\n").encode()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task

