"""Unit tests of sandbox_kernel.api against httpx.MockTransport.

A fake transport is used here on purpose: these tests pin CreateOS behaviours the local engine cannot produce
(429 + Retry-After, 502/503, legacy envelopes, multi-page lists, SSE-prefixed NDJSON, frames after exit_code).
"""

from __future__ import annotations

import asyncio
import base64
import email.utils
import json
import pickle
import time
from typing import Any, Callable

import httpx
import pytest

from sandbox_kernel.api import (
    APITimeoutError,
    APITransportError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    CreateSandboxRequest,
    CreateSandboxResponse,
    DestroyResponse,
    ExecFrame,
    ForkSandboxRequest,
    NotFoundError,
    PatchSandboxRequest,
    PaymentRequiredError,
    PermissionDeniedError,
    ProtocolError,
    RateLimitError,
    SandboxAPIError,
    SandboxClient,
    SandboxStatus,
    SandboxView,
    ServerError,
    ServiceUnavailableError,
    StatusAck,
    TERMINAL,
    TRANSITIONAL,
    WireError,
)
from sandbox_kernel.api import envelope
from sandbox_kernel.api.errors import parse_retry_after

KEY = "fc_test_SECRET_key_0123456789"
BASE = "https://api.example.test"

VIEW = {
    "id": "sb_1",
    "status": "running",
    "vcpu": 1,
    "mem_mib": 256,
    "disk_mib": 10240,
    "created_at": "2026-10-17T09:00:00.123456789Z",
    "ingress_enabled": False,
    "ip": "10.0.0.2",
    "name": "brave-otter",
    "shape": "s-1vcpu-256mb",
    "rootfs": "devbox:1",
    "envs": ["TOKEN"],
    "egress": ["index.example.com:443"],
    "spawn_ms": 812,
}


def ok(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.Response(status, json={"status": "success", "data": data}, headers=headers)


def view(**overrides: Any) -> dict[str, Any]:
    return {**VIEW, **overrides}


class Recorder:
    """A MockTransport handler that records requests and answers from a list of responses (or a callable)."""

    def __init__(self, *responses: httpx.Response | Exception | Callable[[httpx.Request], httpx.Response]):
        self.responses = list(responses)
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        item = self.responses.pop(0) if len(self.responses) > 1 else self.responses[0]
        if isinstance(item, Exception):
            raise item
        if callable(item) and not isinstance(item, httpx.Response):
            return item(request)
        return item

    @property
    def count(self) -> int:
        return len(self.requests)


class FakeSleep:
    def __init__(self) -> None:
        self.calls: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)


def make_client(handler: Any, *, api_key: str | None = KEY, base: str = BASE, **kw: Any) -> tuple[SandboxClient, FakeSleep]:
    sleep = FakeSleep()
    client = SandboxClient(base, api_key, transport=httpx.MockTransport(handler), sleep=sleep, **kw)
    return client, sleep


def assert_no_secret(err: BaseException) -> None:
    for text in (str(err), repr(err), getattr(err, "user_message", lambda: "")(), repr(err.args)):
        assert KEY not in text, text
    if isinstance(err, SandboxAPIError):
        assert KEY not in json.dumps(err.data, default=str)


# ---------------------------------------------------------------------------------------------------------------
# headers, URLs


async def test_headers_and_public_routes() -> None:
    shapes_page = {"data": [], "pagination": {"total": 0, "limit": 500, "offset": 0, "count": 0}}
    rec = Recorder(
        lambda r: ok({"up": True})
        if r.url.path == "/healthz"
        else ok({"ready": True})
        if r.url.path == "/readyz"
        else ok(shapes_page)
        if r.url.path == "/v1/shapes"
        else ok({"rootfs": ["devbox:1"], "default": "devbox:1"})
        if r.url.path == "/v1/rootfs"
        else ok(view())
    )
    client, _ = make_client(rec)
    async with client:
        assert (await client.healthz()).up is True
        assert (await client.readyz()).ready is True
        assert await client.shapes() == []
        cat = await client.rootfs()
        assert cat.default == "devbox:1" and cat.entries is None
        await client.get_sandbox("sb_1")
    assert client.closed
    public = rec.requests[:4]
    assert [r.url.path for r in public] == ["/healthz", "/readyz", "/v1/shapes", "/v1/rootfs"]
    for r in public:
        assert "x-api-key" not in r.headers
    authed = rec.requests[4]
    assert authed.method == "GET" and authed.url.path == "/v1/sandboxes/sb_1"
    assert authed.headers["x-api-key"] == KEY
    for r in rec.requests:
        assert r.headers["user-agent"].startswith("sandbox-kernel/")
        assert r.headers["accept"] == "application/json"


async def test_base_url_prefix_kept_trailing_slash_stripped_and_ids_encoded() -> None:
    rec = Recorder(ok(view(id="a/b c")))
    client, _ = make_client(rec, base="https://h.test/api/")
    async with client:
        await client.get_sandbox("a/b c")
    assert str(rec.requests[0].url) == "https://h.test/api/v1/sandboxes/a%2Fb%20c"
    assert client.base_url == "https://h.test/api"


def test_base_url_validation_and_repr_hides_key() -> None:
    with pytest.raises(ValueError):
        SandboxClient("api.example.test", KEY)
    with pytest.raises(ValueError):
        SandboxClient("https://user:pw@h.test", KEY)
    client = SandboxClient(BASE, KEY, transport=httpx.MockTransport(lambda r: ok({})))
    assert KEY not in repr(client)


async def test_no_key_sends_no_header() -> None:
    rec = Recorder(ok(view()))
    client, _ = make_client(rec, api_key=None)
    async with client:
        await client.get_sandbox("sb_1")
    assert "x-api-key" not in rec.requests[0].headers


# ---------------------------------------------------------------------------------------------------------------
# retry policy


async def test_post_503_retried_twice_then_raises() -> None:
    rec = Recorder(httpx.Response(503, json={"status": "error", "message": "no host with capacity", "code": 503}))
    client, sleep = make_client(rec)
    async with client:
        with pytest.raises(ServiceUnavailableError) as ei:
            await client.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-256mb"))
    assert rec.count == 3
    assert all(r.method == "POST" for r in rec.requests)
    assert len(sleep.calls) == 2
    assert 0.5 <= sleep.calls[0] <= 1.0 and 1.0 <= sleep.calls[1] <= 1.5
    err = ei.value
    assert isinstance(err, ServerError) and err.status_code == 503 and err.code == 503
    assert err.message == "no host with capacity"
    assert err.user_message() == "CreateOS is temporarily unavailable (503): no host with capacity"


async def test_post_503_then_success() -> None:
    rec = Recorder(httpx.Response(503), ok({"id": "sb_9", "status": "running"}))
    client, sleep = make_client(rec)
    async with client:
        res = await client.create_sandbox(CreateSandboxRequest(shape="s"))
    assert res.id == "sb_9" and rec.count == 2 and len(sleep.calls) == 1


@pytest.mark.parametrize("status", [500, 502, 504, 408])
async def test_post_not_retried_on_5xx(status: int) -> None:
    rec = Recorder(httpx.Response(status, json={"status": "error", "message": "boom"}))
    client, sleep = make_client(rec)
    async with client:
        with pytest.raises(SandboxAPIError) as ei:
            await client.exec("sb_1", "true")
    assert rec.count == 1 and sleep.calls == []
    assert ei.value.status_code == status


async def test_post_connect_error_not_retried() -> None:
    rec = Recorder(httpx.ConnectError("connection refused"))
    client, sleep = make_client(rec)
    async with client:
        with pytest.raises(APITransportError) as ei:
            await client.create_sandbox(CreateSandboxRequest(shape="s"))
    assert rec.count == 1 and sleep.calls == []
    assert ei.value.status_code is None
    assert "cannot reach" in ei.value.user_message()
    assert_no_secret(ei.value)


async def test_patch_retried_only_on_429_503() -> None:
    rec = Recorder(httpx.Response(500))
    client, _ = make_client(rec)
    async with client:
        with pytest.raises(ServerError):
            await client.patch_sandbox("sb_1", PatchSandboxRequest(ingress_enabled=True))
    assert rec.count == 1
    assert json.loads(rec.requests[0].content) == {"ingress_enabled": True}


@pytest.mark.parametrize("status", [500, 502, 503, 504, 408])
async def test_get_5xx_retried_twice(status: int) -> None:
    rec = Recorder(httpx.Response(status, json={"status": "error", "message": "upstream"}))
    client, sleep = make_client(rec)
    async with client:
        with pytest.raises(SandboxAPIError) as ei:
            await client.get_sandbox("sb_1")
    assert rec.count == 3 and len(sleep.calls) == 2
    assert ei.value.status_code == status


async def test_get_connect_error_retried_twice_then_transport_error() -> None:
    rec = Recorder(httpx.ConnectError("connection refused"))
    client, sleep = make_client(rec)
    async with client:
        with pytest.raises(APITransportError) as ei:
            await client.get_sandbox("sb_1")
    assert rec.count == 3 and len(sleep.calls) == 2
    assert "after 3 attempts" in str(ei.value)


async def test_get_timeout_raises_timeout_error() -> None:
    rec = Recorder(httpx.ReadTimeout("read timed out"))
    client, _ = make_client(rec, max_retries=0)
    async with client:
        with pytest.raises(APITimeoutError):
            await client.get_sandbox("sb_1")
    assert rec.count == 1


async def test_get_502_then_success_and_delete_put_are_idempotent() -> None:
    rec = Recorder(
        httpx.Response(502),
        ok(view()),
        httpx.ConnectError("reset"),
        ok({"id": "sb_1", "status": "destroying"}),
        httpx.Response(504),
        ok({"id": "sb_1", "egress": ["a.com"]}),
    )
    client, _ = make_client(rec)
    async with client:
        assert (await client.get_sandbox("sb_1")).id == "sb_1"
        d = await client.delete_sandbox("sb_1")
        assert isinstance(d, DestroyResponse) and d.status == SandboxStatus.DESTROYING
        e = await client.set_egress("sb_1", ["a.com"])
        assert e.egress == ["a.com"]
    assert [r.method for r in rec.requests] == ["GET", "GET", "DELETE", "DELETE", "PUT", "PUT"]


async def test_retry_after_delta_seconds_honoured() -> None:
    rec = Recorder(httpx.Response(429, headers={"Retry-After": "7"}), ok({"id": "sb_2"}))
    client, sleep = make_client(rec)
    async with client:
        res = await client.create_sandbox(CreateSandboxRequest(shape="s"))
    assert sleep.calls == [7.0]
    assert res.status == SandboxStatus.RUNNING  # absent status defaults to running


async def test_retry_after_http_date_honoured() -> None:
    when = email.utils.formatdate(time.time() + 10, usegmt=True)
    rec = Recorder(httpx.Response(503, headers={"Retry-After": when}), ok(view()))
    client, sleep = make_client(rec)
    async with client:
        await client.get_sandbox("sb_1")
    assert len(sleep.calls) == 1 and 8.0 <= sleep.calls[0] <= 10.5


async def test_429_exhausted_raises_rate_limit_error() -> None:
    rec = Recorder(httpx.Response(429, json={"status": "fail", "data": "slow down"}, headers={"Retry-After": "3"}))
    client, sleep = make_client(rec)
    async with client:
        with pytest.raises(RateLimitError) as ei:
            await client.exec("sb_1", "true")
    assert rec.count == 3 and sleep.calls == [3.0, 3.0]
    err = ei.value
    assert err.retry_after == 3.0 and err.message == "slow down"
    assert err.user_message() == "rate limited by CreateOS (429), retry in 3 s"


async def test_huge_retry_after_not_waited() -> None:
    rec = Recorder(httpx.Response(429, headers={"Retry-After": "3600"}))
    client, sleep = make_client(rec)
    async with client:
        with pytest.raises(RateLimitError) as ei:
            await client.get_sandbox("sb_1")
    assert rec.count == 1 and sleep.calls == []
    assert ei.value.retry_after == 3600.0
    assert "retry in 3600 s" in ei.value.user_message()


def test_parse_retry_after() -> None:
    assert parse_retry_after(None) is None
    assert parse_retry_after("") is None
    assert parse_retry_after("garbage") is None
    assert parse_retry_after("2") == 2.0
    assert parse_retry_after("-5") == 0.0
    now = 1_800_000_000.0
    assert parse_retry_after(email.utils.formatdate(now + 30, usegmt=True), now=now) == pytest.approx(30, abs=1)
    assert parse_retry_after(email.utils.formatdate(now - 30, usegmt=True), now=now) == 0.0


# ---------------------------------------------------------------------------------------------------------------
# typed errors


@pytest.mark.parametrize(
    ("status", "body", "cls", "user_message"),
    [
        (
            400,
            {"status": "fail", "data": {"shape": "unknown shape"}},
            BadRequestError,
            "request rejected (400): shape: unknown shape",
        ),
        (
            422,
            {"status": "fail", "data": {"auto_pause_after_seconds": "must be 60..86400"}},
            BadRequestError,
            "request rejected (422): auto_pause_after_seconds: must be 60..86400",
        ),
        (
            401,
            {"status": "fail", "data": "invalid api key"},
            AuthenticationError,
            "CreateOS rejected the API key (401): check CREATEOS_SANDBOX_API_KEY",
        ),
        (
            402,
            {"status": "fail", "data": {"code": "insufficient_credit", "message": "no credit"}},
            PaymentRequiredError,
            "CreateOS account is out of credit (402): add credit to create, resume or fork sandboxes",
        ),
        (
            403,
            {"status": "fail", "data": "sandbox quota exceeded"},
            PermissionDeniedError,
            "CreateOS denied the request (403, quota or permission): sandbox quota exceeded",
        ),
        (
            404,
            {"status": "fail", "data": "sandbox not found"},
            NotFoundError,
            "sandbox not found: sb_1 (404)",
        ),
        (
            409,
            {"status": "fail", "data": {"code": "conflict_x", "sandbox": "not paused"}},
            ConflictError,
            "not possible in the sandbox's current state (409): code: conflict_x; sandbox: not paused",
        ),
        (
            500,
            {"status": "error", "message": "internal", "code": 500},
            ServerError,
            "CreateOS server error (500): internal",
        ),
        (
            502,
            None,
            ServerError,
            "CreateOS gateway error (502, e.g. a long-held call timed out upstream): Bad Gateway",
        ),
    ],
)
async def test_typed_errors(status: int, body: Any, cls: type, user_message: str) -> None:
    response = (
        httpx.Response(status, json=body, headers={"X-Request-Id": "req-1"})
        if body is not None
        else httpx.Response(status, text="<html>bad gateway</html>", headers={"X-Fc-Request-Id": "fc-1"})
    )
    if body is None:
        response = httpx.Response(status, content=b"", headers={"X-Fc-Request-Id": "fc-1"})
    rec = Recorder(response)
    client, _ = make_client(rec, max_retries=0)
    async with client:
        with pytest.raises(cls) as ei:
            await client.pause_sandbox("sb_1")
    err = ei.value
    assert type(err) is cls
    assert err.status_code == status and err.method == "POST" and err.path == "/v1/sandboxes/sb_1/pause"
    assert err.user_message() == user_message
    assert "\n" not in err.user_message()
    assert err.request_id == ("req-1" if body is not None else "fc-1")
    assert_no_secret(err)


async def test_error_codes_and_message_rendering() -> None:
    rec = Recorder(
        httpx.Response(409, json={"status": "fail", "data": {"code": "conflict_x", "sandbox": "busy"}}),
        httpx.Response(500, json={"status": "error", "message": "db down", "code": 1234}),
        httpx.Response(404, json={"status": "fail", "data": None}),
        httpx.Response(400, text="plain text, not json"),
    )
    client, _ = make_client(rec, max_retries=0)
    async with client:
        with pytest.raises(ConflictError) as e1:
            await client.fork_sandbox("sb_1")
        with pytest.raises(ServerError) as e2:
            await client.exec("sb_1", "x")
        with pytest.raises(NotFoundError) as e3:
            await client.download_file("sb_1", "/nope")
        with pytest.raises(BadRequestError) as e4:
            await client.exec("sb_1", "x")
    assert e1.value.code == "conflict_x"
    assert e1.value.message == "code: conflict_x; sandbox: busy"
    assert str(e1.value) == "POST /v1/sandboxes/sb_1/fork: HTTP 409: code: conflict_x; sandbox: busy"
    assert e2.value.code == 1234 and e2.value.message == "db down"
    assert e3.value.message == "Not Found"
    assert e3.value.user_message() == "file or sandbox not found: sb_1 (404)"
    assert e4.value.message == "Bad Request"


async def test_api_key_never_in_errors_even_if_server_echoes_it() -> None:
    echo = f"invalid key {KEY}"
    rec = Recorder(
        httpx.Response(401, json={"status": "fail", "data": {"key": echo, "code": KEY}}),
        httpx.Response(500, json={"status": "error", "message": echo}),
        httpx.Response(429, json={"status": "fail", "data": echo}),
        httpx.ConnectError(f"proxy said {KEY}"),
        httpx.Response(200, text=f"not json {KEY}"),
        httpx.Response(200, json={"status": "fail", "data": echo}),
    )
    client, _ = make_client(rec, max_retries=0)
    errors: list[BaseException] = []
    async with client:
        for _ in range(6):
            try:
                await client.exec("sb_1", "x")
            except SandboxAPIError as exc:
                errors.append(exc)
    assert len(errors) == 6
    assert [type(e) for e in errors] == [
        AuthenticationError,
        ServerError,
        RateLimitError,
        APITransportError,
        ProtocolError,
        ProtocolError,
    ]
    for err in errors:
        assert_no_secret(err)
        assert err.__cause__ is None or KEY not in str(err.__cause__)
    # pickling keeps the type and fields
    clone = pickle.loads(pickle.dumps(errors[2]))
    assert type(clone) is RateLimitError and clone.status_code == 429


# ---------------------------------------------------------------------------------------------------------------
# protocol errors


@pytest.mark.parametrize(
    "response",
    [
        httpx.Response(200, text="<html>ok</html>", headers={"Content-Type": "text/html"}),
        httpx.Response(200, json=[1, 2]),
        httpx.Response(200, json={"id": "sb_1"}),  # not JSend
        httpx.Response(200, json={"status": "fail", "data": None}),  # 2xx but not success
        httpx.Response(200, content=b""),
        httpx.Response(302, headers={"Location": "https://elsewhere.test/"}),
        httpx.Response(200, json={"status": "success", "data": view(status="hibernating")}),  # unknown status
        httpx.Response(200, json={"status": "success", "data": {"id": "sb_1"}}),  # missing required fields
    ],
)
async def test_protocol_errors(response: httpx.Response) -> None:
    rec = Recorder(response)
    client, _ = make_client(rec)
    async with client:
        with pytest.raises(ProtocolError) as ei:
            await client.get_sandbox("sb_1")
    assert rec.count == 1
    assert ei.value.user_message().startswith("unexpected response from the sandbox server")
    assert_no_secret(ei.value)


async def test_204_is_none_but_pause_needs_payload() -> None:
    rec = Recorder(httpx.Response(204))
    client, _ = make_client(rec)
    async with client:
        with pytest.raises(ProtocolError):
            await client.pause_sandbox("sb_1")
    assert envelope.parse_response(httpx.Response(204)) is None
    assert envelope.parse_response(httpx.Response(205, content=b"")) is None


# ---------------------------------------------------------------------------------------------------------------
# pagination


async def test_list_sandboxes_follows_three_pages() -> None:
    pages = {
        0: [view(id="sb_a"), view(id="sb_b")],
        2: [view(id="sb_c"), view(id="sb_d")],
        4: [view(id="sb_e", status="paused")],
    }

    def handler(request: httpx.Request) -> httpx.Response:
        offset = int(request.url.params["offset"])
        items = pages[offset]
        return ok({"data": items, "pagination": {"total": 5, "limit": 2, "offset": offset, "count": len(items)}})

    rec = Recorder(handler)
    client, _ = make_client(rec)
    async with client:
        sandboxes = await client.list_sandboxes(status="running")
    assert [s.id for s in sandboxes] == ["sb_a", "sb_b", "sb_c", "sb_d", "sb_e"]
    assert sandboxes[-1].status == SandboxStatus.PAUSED
    assert [r.url.params["offset"] for r in rec.requests] == ["0", "2", "4"]
    for r in rec.requests:
        assert r.url.path == "/v1/sandboxes"
        assert r.url.params["limit"] == "500" and r.url.params["status"] == "running"
        assert r.headers["x-api-key"] == KEY


async def test_pagination_stops_on_empty_page_and_missing_total() -> None:
    rec = Recorder(
        ok({"data": [view(id="sb_a")], "pagination": {"total": 10, "offset": 0, "count": 1}}),
        ok({"data": [], "pagination": {"total": 10, "offset": 1, "count": 0}}),
        ok({"data": [view(id="sb_z")]}),  # no pagination at all -> one page
    )
    client, _ = make_client(rec)
    async with client:
        assert [s.id for s in await client.list_sandboxes()] == ["sb_a"]
        assert rec.count == 2
        assert [s.id for s in await client.list_sandboxes()] == ["sb_z"]
        assert rec.count == 3
        assert "status" not in rec.requests[0].url.params


@pytest.mark.parametrize(
    "payload",
    [
        {"shapes": [{"id": "s-1vcpu-256mb", "vcpu": 1, "mem_mib": 256, "default_disk_mib": 10240}]},
        [{"id": "s-1vcpu-256mb", "vcpu": 1, "mem_mib": 256, "default_disk_mib": 10240}],
        {
            "data": [{"id": "s-1vcpu-256mb", "vcpu": 1, "mem_mib": 256, "default_disk_mib": 10240, "cpu_quota_pct": 25}],
            "pagination": {"total": 1, "limit": 500, "offset": 0, "count": 1},
        },
    ],
)
async def test_shapes_legacy_and_current_envelopes(payload: Any) -> None:
    rec = Recorder(ok(payload))
    client, _ = make_client(rec)
    async with client:
        shapes = await client.shapes()
    assert [s.id for s in shapes] == ["s-1vcpu-256mb"] and shapes[0].mem_mib == 256
    assert rec.count == 1 and "x-api-key" not in rec.requests[0].headers


def test_unwrap_page_rejects_garbage() -> None:
    assert envelope.unwrap_page(None) == ([], None)
    with pytest.raises(ProtocolError):
        envelope.unwrap_page({"nope": 1})
    with pytest.raises(ProtocolError):
        envelope.unwrap_page("x")


# ---------------------------------------------------------------------------------------------------------------
# request bodies


async def test_create_body_omits_unset_fields() -> None:
    rec = Recorder(ok({"id": "sb_1", "status": "running", "vcpu": 1, "mem_mib": 256, "disk_mib": 10240}))
    client, _ = make_client(rec)
    async with client:
        res = await client.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-256mb"))
        await client.create_sandbox(
            CreateSandboxRequest(
                shape="s-1vcpu-256mb",
                rootfs="devbox:1",
                egress=[],
                envs={"A": "1"},
                ingress_enabled=False,
                auto_pause_after_seconds=600,
            ),
            timeout=5,
        )
    assert isinstance(res, CreateSandboxResponse) and res.vcpu == 1
    first, second = rec.requests
    assert first.method == "POST" and first.url.path == "/v1/sandboxes"
    assert first.headers["content-type"] == "application/json"
    assert json.loads(first.content) == {"shape": "s-1vcpu-256mb"}
    assert json.loads(second.content) == {
        "shape": "s-1vcpu-256mb",
        "rootfs": "devbox:1",
        "egress": [],
        "envs": {"A": "1"},
        "ingress_enabled": False,
        "auto_pause_after_seconds": 600,
    }


def test_auto_pause_validation() -> None:
    for bad in (59, 86401):
        with pytest.raises(WireError):
            CreateSandboxRequest(shape="s", auto_pause_after_seconds=bad)
        with pytest.raises(WireError):
            PatchSandboxRequest(auto_pause_after_seconds=bad)
    assert CreateSandboxRequest(shape="s", auto_pause_after_seconds=60).auto_pause_after_seconds == 60
    assert PatchSandboxRequest(disable_auto_pause=True).to_wire() == {"disable_auto_pause": True}


async def test_fork_body_serialisation() -> None:
    rec = Recorder(ok(view(id="sb_child", status="forking", forked_from="sb_1")))
    client, _ = make_client(rec)
    async with client:
        child = await client.fork_sandbox("sb_1")
        await client.fork_sandbox("sb_1", ForkSandboxRequest())
        await client.fork_sandbox("sb_1", ForkSandboxRequest(egress=[], ingress_enabled=False))
        await client.fork_sandbox("sb_1", ForkSandboxRequest(start_paused=True, envs={}, egress=None))
    assert child.forked_from == "sb_1" and child.status == SandboxStatus.FORKING
    bodies = [json.loads(r.content) for r in rec.requests]
    assert bodies == [{}, {}, {"egress": [], "ingress_enabled": False}, {"start_paused": True, "envs": {}}]
    assert all(r.url.path == "/v1/sandboxes/sb_1/fork" for r in rec.requests)


async def test_pause_resume_accept_view_or_ack() -> None:
    rec = Recorder(ok({"id": "sb_1", "status": "pausing"}), ok(view(status="resuming")))
    client, _ = make_client(rec)
    async with client:
        ack = await client.pause_sandbox("sb_1")
        full = await client.resume_sandbox("sb_1")
    assert type(ack) is StatusAck and ack.status == SandboxStatus.PAUSING
    assert isinstance(full, SandboxView) and full.status == "resuming"
    for r in rec.requests:
        assert r.method == "POST" and r.content == b""
        assert "content-type" not in r.headers


async def test_set_egress_none_sends_empty_list_and_get_egress() -> None:
    rec = Recorder(ok({"id": "sb_1", "egress": []}), ok({"id": "sb_1"}))
    client, _ = make_client(rec)
    async with client:
        assert (await client.set_egress("sb_1", None)).egress == []
        assert (await client.get_egress("sb_1")).egress is None
    assert json.loads(rec.requests[0].content) == {"egress": []}
    assert rec.requests[0].method == "PUT" and rec.requests[1].method == "GET"


async def test_buffered_exec() -> None:
    rec = Recorder(ok({"result": {"stdout": "hi\n", "stderr": "", "exit_code": 0}, "exec_ms": 12}))
    client, _ = make_client(rec)
    async with client:
        res = await client.exec("sb_1", "bash", ["-lc", "echo hi"], timeout=3)
    assert res.result.stdout == "hi\n" and res.result.exit_code == 0 and res.exec_ms == 12.0
    req = rec.requests[0]
    assert req.url.path == "/v1/sandboxes/sb_1/exec" and "stream" not in req.url.params
    assert json.loads(req.content) == {"cmd": "bash", "args": ["-lc", "echo hi"]}


async def test_readyz_503_decoded() -> None:
    rec = Recorder(httpx.Response(503, json={"status": "fail", "data": {"ready": False, "reason": "scheduler"}}))
    client, sleep = make_client(rec)
    async with client:
        r = await client.readyz()
    assert r.ready is False and r.reason == "scheduler"
    assert rec.count == 1 and sleep.calls == []


# ---------------------------------------------------------------------------------------------------------------
# streaming exec


class Body(httpx.AsyncByteStream):
    """A streamed response body; records when the client closes it."""

    def __init__(self, gen_factory: Callable[[], Any]) -> None:
        self._factory = gen_factory
        self.closed = False

    async def __aiter__(self):
        async for chunk in self._factory():
            yield chunk

    async def aclose(self) -> None:
        self.closed = True


def stream_response(lines: list[bytes], status: int = 200, bodies: list[Body] | None = None) -> Callable:
    async def gen():
        for chunk in lines:
            yield chunk

    def handler(request: httpx.Request) -> httpx.Response:
        body = Body(gen)
        if bodies is not None:
            bodies.append(body)
        return httpx.Response(status, stream=body, headers={"Content-Type": "application/x-ndjson"})

    return handler


async def test_exec_stream_sse_prefixes_and_frames_after_exit() -> None:
    lines = [
        b'{"hb":true}\n',
        b"\n",
        b": keep-alive comment\n",
        b"event: message\n",
        b"id: 7\n",
        b"retry: 1000\n",
        b'data: {"stdout":"hi\\n"}\n',
        b'  {"stderr":"warn"}  \r\n',
        b'{"std',  # a line split across chunks
        b'out":"more"}\n{}\n',
        b'{"error":"oops","unknown":1}\n',
        b'{"exit_code":0}\n',
        b'{"stdout":"late"}',  # after exit_code, no trailing newline
    ]
    rec = Recorder(stream_response(lines))
    client, sleep = make_client(rec)
    async with client:
        async with client.exec_stream("sb_1", "bash", ["-lc", "echo hi"]) as frames:
            got = [f async for f in frames]
    assert got == [
        ExecFrame(hb=True),
        ExecFrame(stdout="hi\n"),
        ExecFrame(stderr="warn"),
        ExecFrame(stdout="more"),
        ExecFrame(),
        ExecFrame(error="oops"),
        ExecFrame(exit_code=0),
        ExecFrame(stdout="late"),
    ]
    assert got[0].is_heartbeat
    req = rec.requests[0]
    assert req.method == "POST" and req.url.path == "/v1/sandboxes/sb_1/exec"
    assert req.url.params["stream"] == "true"
    assert json.loads(req.content) == {"cmd": "bash", "args": ["-lc", "echo hi"], "stream": True}
    assert req.headers["x-api-key"] == KEY
    assert sleep.calls == []


@pytest.mark.parametrize("bad", [b"[1,2]\n", b"42\n", b"not json\n", b'data: "str"\n', b'{"exit_code":"x"}\n'])
async def test_exec_stream_bad_line_is_protocol_error(bad: bytes) -> None:
    bodies: list[Body] = []
    rec = Recorder(stream_response([b'{"stdout":"a"}\n', bad, b'{"exit_code":0}\n'], bodies=bodies))
    client, _ = make_client(rec)
    seen: list[ExecFrame] = []
    async with client:
        with pytest.raises(ProtocolError) as ei:
            async with client.exec_stream("sb_1", "x") as frames:
                async for f in frames:
                    seen.append(f)
    assert seen == [ExecFrame(stdout="a")]
    assert bodies[0].closed
    assert ei.value.status_code == 200
    assert_no_secret(ei.value)


async def test_exec_stream_non_2xx_raises_typed_error_and_is_not_retried() -> None:
    rec = Recorder(
        lambda r: httpx.Response(503, json={"status": "error", "message": "no capacity"}, headers={"Retry-After": "1"})
    )
    client, sleep = make_client(rec)
    async with client:
        with pytest.raises(ServiceUnavailableError):
            async with client.exec_stream("sb_1", "x"):
                pytest.fail("must not enter")  # pragma: no cover
    assert rec.count == 1 and sleep.calls == []
    rec404 = Recorder(httpx.Response(404, json={"status": "fail", "data": "sandbox not found"}))
    client, _ = make_client(rec404)
    async with client:
        with pytest.raises(NotFoundError):
            async with client.exec_stream("sb_1", "x"):
                pass  # pragma: no cover


async def test_exec_stream_connect_error_not_retried() -> None:
    rec = Recorder(httpx.ConnectError("refused"))
    client, sleep = make_client(rec)
    async with client:
        with pytest.raises(APITransportError):
            async with client.exec_stream("sb_1", "x"):
                pass  # pragma: no cover
    assert rec.count == 1 and sleep.calls == []


async def test_exec_stream_is_incremental_and_early_exit_closes() -> None:
    """The first frame reaches the caller before the server has produced the rest; leaving early closes."""
    release = asyncio.Event()
    produced: list[str] = []

    async def gen():
        produced.append("first")
        yield b'{"stdout":"first"}\n'
        await release.wait()
        produced.append("second")
        yield b'{"stdout":"second"}\n'
        await asyncio.sleep(10)  # would hang the test if the client buffered the whole body
        yield b'{"exit_code":0}\n'  # pragma: no cover

    body = Body(gen)
    client, _ = make_client(lambda r: httpx.Response(200, stream=body))
    async with client:
        async with client.exec_stream("sb_1", "x") as frames:
            it = frames.__aiter__()
            first = await asyncio.wait_for(it.__anext__(), 1)
            assert first.stdout == "first" and produced == ["first"]
            assert not body.closed
            release.set()
            second = await asyncio.wait_for(it.__anext__(), 1)
            assert second.stdout == "second"
        # leaving the block early closed the response
        assert body.closed and frames.response.is_closed


async def test_exec_stream_mid_stream_drop_is_transport_error() -> None:
    async def body():
        yield b'{"stdout":"a"}\n'
        raise httpx.ReadError("connection reset")

    client, _ = make_client(lambda r: httpx.Response(200, content=body()))
    seen = []
    async with client:
        with pytest.raises(APITransportError):
            async with client.exec_stream("sb_1", "x") as frames:
                async for f in frames:
                    seen.append(f)
    assert seen == [ExecFrame(stdout="a")]


# ---------------------------------------------------------------------------------------------------------------
# files


async def test_upload_file() -> None:
    rec = Recorder(ok({"bytes": 3, "path": "/tmp/a b.txt"}))
    client, _ = make_client(rec)
    async with client:
        res = await client.upload_file("sb_1", "/tmp/a b.txt", b"abc")
    assert res.bytes == 3 and res.path == "/tmp/a b.txt"
    req = rec.requests[0]
    assert req.method == "PUT" and req.url.path == "/v1/sandboxes/sb_1/files"
    assert req.url.params["path"] == "/tmp/a b.txt"
    assert req.headers["content-type"] == "application/octet-stream"
    assert req.content == b"abc" and req.headers["x-api-key"] == KEY


async def test_upload_empty_payload_and_never_retried() -> None:
    rec = Recorder(ok({}), httpx.Response(503), httpx.ConnectError("reset"))
    client, sleep = make_client(rec)
    async with client:
        assert (await client.upload_file("sb_1", "/a", b"x")).bytes is None
        with pytest.raises(ServiceUnavailableError):
            await client.upload_file("sb_1", "/a", b"x")
        with pytest.raises(APITransportError):
            await client.upload_file("sb_1", "/a", b"x")
    assert rec.count == 3 and sleep.calls == []


async def test_download_file_raw_bytes_and_never_retried() -> None:
    payload = bytes(range(256))
    rec = Recorder(
        httpx.Response(200, content=payload, headers={"Content-Type": "application/octet-stream"}),
        httpx.Response(500, json={"status": "error", "message": "io"}),
        httpx.Response(404, json={"status": "fail", "data": "file not found"}),
    )
    client, sleep = make_client(rec)
    async with client:
        assert await client.download_file("sb_1", "/bin.dat") == payload
        with pytest.raises(ServerError):
            await client.download_file("sb_1", "/bin.dat")
        with pytest.raises(NotFoundError) as ei:
            await client.download_file("sb_1", "/missing")
    assert rec.count == 3 and sleep.calls == []
    assert rec.requests[0].url.params["path"] == "/bin.dat"
    assert ei.value.user_message() == "file or sandbox not found: sb_1 (404): file not found"


# ---------------------------------------------------------------------------------------------------------------
# models and envelope builders


def test_sandbox_view_round_trips_exactly() -> None:
    wire = view(
        forked_from="sb_0",
        paused_at="2026-10-17T09:01:00Z",
        running_at="2026-10-17T09:00:01Z",
        last_resumed_at="2026-10-17T09:02:00.5+02:00",
        auto_pause_after_seconds=600,
    )
    v = SandboxView.from_wire({**wire, "future_field": {"x": 1}})
    assert v.to_wire() == wire
    assert json.loads(json.dumps(envelope.success(v))) == {"status": "success", "data": wire}


def test_status_sets() -> None:
    assert len(SandboxStatus) == 10
    assert TRANSITIONAL == {"creating", "pausing", "resuming", "forking", "destroying"}
    assert TERMINAL == {"destroyed", "failed"}
    assert SandboxStatus.ERROR not in TERMINAL and not SandboxStatus.ERROR.is_transitional
    assert str(SandboxStatus.RUNNING) == "running" and json.dumps(SandboxStatus.PAUSED) == '"paused"'


def test_envelope_builders() -> None:
    assert envelope.success({"up": True}) == {"status": "success", "data": {"up": True}}
    assert envelope.fail({"shape": "unknown", "code": "bad_shape"}) == {
        "status": "fail",
        "data": {"shape": "unknown", "code": "bad_shape"},
    }
    assert envelope.fail(None) == {"status": "fail", "data": None}
    assert envelope.error("boom", 500) == {"status": "error", "message": "boom", "code": 500}
    page = envelope.paginated([ExecFrame(stdout="x")], total=3, limit=1, offset=0)
    assert page == {"data": [{"stdout": "x"}], "pagination": {"total": 3, "limit": 1, "offset": 0, "count": 1}}
    assert envelope.success(ForkSandboxRequest(egress=[]))["data"] == {"egress": []}


async def test_unix_socket_transport(tmp_path) -> None:
    sock = str(tmp_path / "api.sock")
    seen: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        seen.append(head)
        body = json.dumps({"status": "success", "data": {"up": True}}).encode()
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\nConnection: close\r\n\r\n"
            + body
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_unix_server(serve, path=sock)
    try:
        async with SandboxClient("http://localhost", "tok_local_123", uds=sock, timeout=5) as client:
            assert (await client.healthz()).up is True
    finally:
        server.close()
        await server.wait_closed()
    assert seen[0].startswith(b"GET /healthz HTTP/1.1")


def test_fail_data_with_a_message_shows_that_sentence() -> None:
    """The local engine (and CreateOS validation) send {"message": ..., "code": ...} in fail data."""
    response = httpx.Response(
        409, json={"status": "fail", "data": {"message": "only a paused sandbox can be forked", "code": "invalid_state"}},
        request=httpx.Request("POST", "http://engine/v1/sandboxes/sb_1/fork"))
    err = envelope.error_from_response(response, method="POST", path="/v1/sandboxes/sb_1/fork")
    assert isinstance(err, ConflictError)
    assert (err.message, err.code) == ("only a paused sandbox can be forked", "invalid_state")
    assert err.user_message() == "not possible in the sandbox's current state (409): only a paused sandbox can be forked"


def test_bounded_lines_drop_what_passes_the_limit_and_count_it() -> None:
    from sandbox_kernel.api import BoundedLines, OversizedLine

    lines = BoundedLines(8)
    assert lines.feed("abc") == [] and lines.feed("de\nfg") == ["abcde"]
    assert lines.feed("x" * 100) == []  # held: at most 8 characters, here none
    last = lines.feed("y\nok\n")
    assert isinstance(last[0], OversizedLine) and last[0].size == 103 and last[1:] == ["ok"]
    assert lines.feed("tail") == [] and lines.close() == "tail" and lines.close() == ""
    assert lines.feed("\na\n\nb\nc") == ["", "a", "", "b"] and lines.feed("\n") == ["c"]


def _frame_as_json_reads_it(line: str) -> Any:
    """What the plain path makes of a process stream line: a frame's fields and output, or None."""
    from sandbox_kernel.api.models import ProcessFrame

    try:
        obj = json.loads(line)
        frame = ProcessFrame.from_wire(obj)
    except ValueError:  # not JSON, or not a frame (WireError)
        return None
    try:
        data: Any = frame.data
    except ValueError:
        data = "undecodable"
    return frame.to_wire(), data


def test_process_frames_are_read_as_json_reads_them() -> None:
    """ProcessStream cuts a data frame's output out of its line before parsing the rest (a
    fast path): real frames and seeded manglings of them (characters that mean something to
    JSON inserted, deleted or swapped, fields doubled or hidden in strings) read exactly as
    json.loads and the frame model read them, or are refused as they are."""
    import random

    from sandbox_kernel.api.client import ProcessStream, _BadFrame

    stream = ProcessStream.__new__(ProcessStream)  # _frame needs no response
    shuffle = random.Random(11)
    output = base64.b64encode(bytes(range(256)) * 40).decode()
    real = ['{"type":"data","seq":7,"stream":"stdout","data_base64":"%s"}' % output,
            '{"type":"data","seq":8,"stream":"stderr","data_base64":"%s","oldest_available_seq":3}' % output,
            '{"type":"exit","seq":8,"exit_code":0}', '{"type":"heartbeat"}']
    lines = list(real) + [
        '{"type":"data","seq":1,"data_base64":"QUJD","data_base64":""}',
        '{"type":"data","seq":1,"data_base64":"","data_base64":"QUJD"}',
        '{"type":"data","seq":1,"error":"\\"data_base64\\":\\"","data_base64":"QUJD"}',
        '{"type":"data","seq":1,"x":{"data_base64":"QUJD"},"data_base64":""}',
        '{"type":"data","seq":1,"x":{"data_base64":"QUJD"}}', '{"data_base64": "","x":{"data_base64":"QUJD"}}',
        '{"type":"data","seq":1,"data_base64":"QU\\u004aD"}', '{"type":"data","seq":1,"data_base64":"QU\tJD"}',
        '["type","data_base64":"QUJD"]', '{"type":"data","data_base64":"QUJD"', '{"type":"data","data_base64":"!!"}']
    significant = ['"', "\\", ":", ",", "{", "}", "[", "]", " ", "\t", "\x00", "=", "/", "A", '"data_base64":"']
    taken_fast = 0
    for _ in range(3000):
        line = list(shuffle.choice(real))
        for _ in range(shuffle.randint(1, 3)):
            at = shuffle.randrange(len(line))
            action = shuffle.choice(("insert", "delete", "swap"))
            if action == "insert":
                line.insert(at, shuffle.choice(significant))
            elif action == "delete":
                del line[at]
            else:
                other = shuffle.randrange(len(line))
                line[at], line[other] = line[other], line[at]
        lines.append("".join(line))
    for line in lines:
        expected = _frame_as_json_reads_it(line)
        try:
            frame = stream._frame(line)
        except _BadFrame:
            assert expected is None, line[:200]
            continue
        try:
            data: Any = frame.data
        except ValueError:
            data = "undecodable"
        assert (frame.to_wire(), data) == expected, line[:200]
        taken_fast += frame._decoded is not None
    assert taken_fast > 100  # the comparison covers the fast path, not only the plain one


def test_httpcore_finds_what_it_imports_on_every_request() -> None:
    """httpcore imports sniffio in each request (to tell asyncio from trio); a missing sniffio
    means a failed import, a search of sys.path, per request. It is a dependency of ours."""
    import sys

    from httpcore._synchronization import current_async_library

    looked_up: list[str] = []

    class Recorder:
        @staticmethod
        def find_spec(name: str, *_: Any) -> None:
            looked_up.append(name)

    async def ask() -> str:
        return current_async_library()

    sys.meta_path.insert(0, Recorder())  # type: ignore[arg-type]
    try:
        assert asyncio.run(ask()) == "asyncio"
    finally:
        sys.meta_path.pop(0)
    assert looked_up == []


def test_stream_reads_are_widened_to_what_a_busy_stream_holds() -> None:
    """Importing the client widens httpcore's reads (see _STREAM_READ_BYTES): an httpcore that
    drops or renames the knob would silently give back a quarter of a long print's speed."""
    import httpcore

    from sandbox_kernel.api import client

    assert httpcore.AsyncHTTP11Connection.READ_NUM_BYTES >= client._STREAM_READ_BYTES
