"""The API client against the real local engine, over loopback HTTP and over a unix socket.

The same tests run on both transports: the engine is one CreateOS-compatible server, and
the client must not care how it is reached.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from sandbox_kernel.api import (
    AuthenticationError,
    BadRequestError,
    ConflictError,
    CreateProcessRequest,
    CreateSandboxRequest,
    NotFoundError,
    SandboxClient,
    SandboxStatus,
)
from sandbox_kernel.local.service import EngineEndpoint


@pytest.fixture(params=["tcp", "unix"])
async def client(request: pytest.FixtureRequest, engine: EngineEndpoint) -> AsyncIterator[SandboxClient]:
    if request.param == "unix":
        assert engine.socket, "the engine should serve a unix socket"
        api = SandboxClient("http://localhost", engine.token, uds=engine.socket)
    else:
        api = SandboxClient(engine.url, engine.token)
    async with api:
        yield api


@pytest.fixture
async def sandbox(client: SandboxClient) -> AsyncIterator[str]:
    created = await client.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-512mb"))
    yield created.id
    await client.delete_sandbox(created.id)


async def test_public_routes_need_no_key(engine: EngineEndpoint) -> None:
    async with SandboxClient(engine.url) as anonymous:
        assert (await anonymous.healthz()).up
        shapes = await anonymous.shapes()
        assert "s-1vcpu-256mb" in {s.id for s in shapes}
        catalog = await anonymous.rootfs()
        assert catalog.default in catalog.rootfs
        with pytest.raises(AuthenticationError) as caught:
            await anonymous.list_sandboxes()
        assert caught.value.status_code == 401


async def test_wrong_key_is_rejected_and_not_echoed(engine: EngineEndpoint) -> None:
    async with SandboxClient(engine.url, "wrong-key-123") as intruder:
        with pytest.raises(AuthenticationError) as caught:
            await intruder.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-256mb"))
    assert "wrong-key-123" not in str(caught.value) + repr(caught.value)


async def test_create_get_list_delete(client: SandboxClient) -> None:
    created = await client.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-256mb", name="api-test-sb",
                                                               envs={"GREETING": "hello"}))
    assert created.status == SandboxStatus.RUNNING
    assert created.vcpu == 1 and created.mem_mib == 256 and created.shape == "s-1vcpu-256mb"
    view = await client.get_sandbox(created.id)
    assert view.name == "api-test-sb" and view.envs == ["GREETING"]  # names only, never values
    assert created.id in {sb.id for sb in await client.list_sandboxes()}
    with pytest.raises(ConflictError):
        await client.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-256mb", name="api-test-sb"))
    env = await client.exec(created.id, "sh", ["-c", "echo $GREETING"])
    assert env.result.stdout == "hello\n"
    gone = await client.delete_sandbox(created.id)
    assert gone.status == SandboxStatus.DESTROYED
    assert (await client.get_sandbox(created.id)).status == SandboxStatus.DESTROYED
    assert created.id not in {sb.id for sb in await client.list_sandboxes()}
    with pytest.raises(ConflictError):
        await client.exec(created.id, "true")


async def test_unknown_ids_and_bad_requests(client: SandboxClient) -> None:
    with pytest.raises(NotFoundError):
        await client.get_sandbox("sb-does-not-exist")
    with pytest.raises(NotFoundError):
        await client.delete_sandbox("sb-does-not-exist")
    with pytest.raises(BadRequestError) as caught:
        await client.create_sandbox(CreateSandboxRequest(shape="s-99vcpu-1tb"))
    assert "s-99vcpu-1tb" in caught.value.user_message()


async def test_pagination_follows_createos_shape(engine: EngineEndpoint, sandbox: str) -> None:
    async with httpx.AsyncClient(base_url=engine.url, headers={"X-Api-Key": engine.token}) as raw:
        body = (await raw.get("/v1/shapes", params={"limit": 2, "offset": 1})).json()
        assert body["status"] == "success"
        page = body["data"]
        assert len(page["data"]) == 2
        assert page["pagination"] == {"total": 7, "limit": 2, "offset": 1, "count": 2}
        listed = (await raw.get("/v1/sandboxes", params={"limit": 500})).json()["data"]
        assert sandbox in {item["id"] for item in listed["data"]}


async def test_buffered_exec(client: SandboxClient, sandbox: str) -> None:
    response = await client.exec(sandbox, "sh", ["-c", "echo out; echo err >&2; exit 3"])
    assert (response.result.stdout, response.result.stderr, response.result.exit_code) == ("out\n", "err\n", 3)
    missing = await client.exec(sandbox, "no-such-command")
    assert missing.result.exit_code == -1 and "no-such-command" in (missing.result.error or "")


async def test_streaming_exec_delivers_output_before_the_command_ends(client: SandboxClient, sandbox: str) -> None:
    script = "echo first; while [ ! -f /tmp/go ]; do sleep 0.05; done; echo second; exit 7"
    seen: list[str] = []
    async with client.exec_stream(sandbox, "sh", ["-c", script]) as frames:
        async for frame in frames:
            if frame.stdout:
                seen.append(frame.stdout)
                if frame.stdout == "first\n":
                    # The command is still waiting for us: the frame really was streamed.
                    await client.exec(sandbox, "touch", ["/tmp/go"])
            if frame.exit_code is not None:
                seen.append(f"exit {frame.exit_code}")
    assert seen == ["first\n", "second\n", "exit 7"]


async def test_abandoned_stream_kills_the_command(client: SandboxClient, sandbox: str) -> None:
    async with client.exec_stream(sandbox, "sh", ["-c", "echo $$ > /tmp/victim; echo started; sleep 600"]) as frames:
        async for frame in frames:
            if frame.stdout:
                break
    probe = "pid=$(cat /tmp/victim); for i in $(seq 100); do kill -0 $pid 2>/dev/null || exit 0; sleep 0.05; done; exit 1"
    assert (await client.exec(sandbox, "sh", ["-c", probe])).result.exit_code == 0


async def test_files_round_trip_and_errors(client: SandboxClient, sandbox: str) -> None:
    payload = bytes(range(256)) * 1000
    uploaded = await client.upload_file(sandbox, "/workspace/blob.bin", payload)
    assert uploaded.bytes == len(payload)
    assert await client.download_file(sandbox, "/workspace/blob.bin") == payload
    listing = await client.exec(sandbox, "ls", ["-l", "/workspace/blob.bin"])
    assert str(len(payload)) in listing.result.stdout
    with pytest.raises(BadRequestError):
        await client.upload_file(sandbox, "relative/path", b"x")
    with pytest.raises(NotFoundError):
        await client.upload_file(sandbox, "/workspace/no/such/dir/file", b"x")
    with pytest.raises(NotFoundError):
        await client.download_file(sandbox, "/workspace/missing")


async def test_process_input_answers(engine: EngineEndpoint, sandbox: str) -> None:
    """A process's input is answered by a shortcut past FastAPI's routing when well formed,
    by the route otherwise: either way with the route's envelopes, codes and headers."""
    key = {"X-Api-Key": engine.token}
    async with SandboxClient(engine.url, engine.token) as api, httpx.AsyncClient(base_url=engine.url) as raw:
        process = await api.create_process(sandbox, CreateProcessRequest(cmd="cat", args=[]))
        route = f"/v1/sandboxes/{sandbox}/processes/{process.process_id}/input"

        async def post(body: bytes, content_type: str | None = "application/json", headers: dict | None = None,
                       path: str = route) -> httpx.Response:
            sent = {**(key if headers is None else headers), **({"Content-Type": content_type} if content_type else {})}
            return await raw.post(path, content=body, headers=sent)

        ok = await post(b'{"data_base64": "aGkK"}')
        assert ok.status_code == 200 and ok.json() == {"status": "success", "data": {"input_seq": 1}}
        assert ok.headers["X-Request-Id"]
        with_charset = await post(b'{"data_base64": "aGkK"}', "application/json; charset=utf-8")
        assert with_charset.json()["data"] == {"input_seq": 2}

        def fail(response: httpx.Response, status: int) -> dict:
            assert response.status_code == status, response.text
            body = response.json()
            assert body["status"] == "fail" and response.headers["X-Request-Id"]
            return body["data"]

        assert fail(await post(b'{"data_base64": "aGkK"}', headers={}), 401)["code"] == "unauthorized"
        assert fail(await post(b'{"data_base64": '), 400)["code"] == "invalid_json"
        assert fail(await post(b'{"data": "aGkK"}'), 400)["code"] == "validation"
        assert fail(await post(b'{"data_base64": "aGkK"}', "text/plain"), 400)["code"] == "validation"
        assert fail(await post(b'{"data_base64": "aGkK"}', None), 400)["code"] == "validation"
        assert fail(await post(b'{"data_base64": "not base64!"}'), 400)["code"] == "invalid_base64"
        assert fail(await post(b'{"data_base64": "aGkK"}', path=route.replace(process.process_id, "proc-nope")),
                    404)["code"] == "process_not_found"
        assert fail(await post(b'{"data_base64": "aGkK"}', path=route.replace(sandbox, "sb-nope")), 404)
        await api.close_process_stdin(sandbox, process.process_id)
        assert fail(await post(b'{"data_base64": "aGkK"}'), 409)["code"] == "process_conflict"
        assert (await raw.get(route, headers=key)).status_code == 405  # the app's answer, as before
