"""Bad input to the engine's API is a 4xx with a JSend body, never a 500, and the
connection it came on keeps working (issue 12, item 8). Each case first shows the input
really is what broke the engine before (over the agent's limits, over the disk)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest

from attack_helpers import ONCE
from sandbox_kernel.local.agent_client import MAX_REPLY_LINE, MAX_REQUEST
from sandbox_kernel.local.engine import MAX_DISK_MIB
from sandbox_kernel.local.service import EngineEndpoint

pytestmark = [pytest.mark.slow, ONCE]

DISK_MIB = 64


@pytest.fixture
async def http(engine: EngineEndpoint) -> AsyncIterator[httpx.AsyncClient]:
    """One keep-alive connection for a whole test (a pool of one)."""
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    async with httpx.AsyncClient(base_url=engine.url, headers={"X-Api-Key": engine.token},
                                 timeout=120, trust_env=False, limits=limits) as client:
        yield client


@pytest.fixture
async def sandbox(http: httpx.AsyncClient) -> AsyncIterator[str]:
    created = await http.post("/v1/sandboxes", json={"shape": "s-1vcpu-512mb", "disk_mib": DISK_MIB})
    assert created.status_code == 200, created.text
    sandbox_id = created.json()["data"]["id"]
    yield sandbox_id
    await http.delete(f"/v1/sandboxes/{sandbox_id}")


async def still_serves(http: httpx.AsyncClient, sandbox: str) -> None:
    """The same connection answers the next request."""
    response = await http.get(f"/v1/sandboxes/{sandbox}")
    assert response.status_code == 200 and response.json()["data"]["status"] == "running"


def fail(response: httpx.Response, status: int, code: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["status"] == "fail" and body["data"]["code"] == code, body
    return body["data"]["message"]


async def test_control_bytes_in_exec_output(http: httpx.AsyncClient, sandbox: str) -> None:
    size = 1 << 20
    # 64 KiB of \x01 escape to 384 KiB of JSON per agent frame: past the engine's old
    # 256 KiB line limit, well inside its current one.
    assert 6 * 64 * 1024 > 256 * 1024 and 6 * 64 * 1024 < MAX_REPLY_LINE
    write = f"import sys; sys.stdout.buffer.write(b'\\x01' * {size})"
    buffered = await http.post(f"/v1/sandboxes/{sandbox}/exec", json={"cmd": "python3", "args": ["-c", write]})
    assert buffered.status_code == 200
    assert buffered.json()["data"]["result"]["stdout"] == "\x01" * size
    streamed = await http.post(f"/v1/sandboxes/{sandbox}/exec", params={"stream": "true"},
                               json={"cmd": "python3", "args": ["-c", write], "stream": True})
    assert streamed.status_code == 200
    frames = [httpx.Response(200, content=line).json() for line in streamed.content.splitlines()]
    assert "".join(frame.get("stdout", "") for frame in frames) == "\x01" * size
    assert frames[-1] == {"exit_code": 0}
    await still_serves(http, sandbox)


async def test_exec_argument_over_the_agents_limit(http: httpx.AsyncClient, sandbox: str) -> None:
    for stream in (False, True):
        response = await http.post(f"/v1/sandboxes/{sandbox}/exec", params={"stream": str(stream).lower()},
                                   json={"cmd": "echo", "args": ["x" * (MAX_REQUEST + 1)], "stream": stream})
        assert "sandbox agent takes at most" in fail(response, 400, "request_too_large")
        await still_serves(http, sandbox)


async def test_strings_no_program_can_be_given(http: httpx.AsyncClient, sandbox: str) -> None:
    """A NUL or a lone surrogate fits JSON but no command line: the command cannot start
    (as a missing program cannot), said in its result; a managed process is refused."""
    for body in ({"cmd": "echo", "args": ["a\u0000b"]}, {"cmd": "ec\u0000ho"}, {"cmd": "echo", "args": ["\udb70"]},
                 {"cmd": "echo", "env": {"A": "\u0000"}}):
        # Sent as JSON text: httpx would not encode a lone surrogate itself.
        raw = json.dumps(body).encode()
        response = await http.post(f"/v1/sandboxes/{sandbox}/exec", content=raw,
                                   headers={"Content-Type": "application/json"})
        assert response.status_code == 200, response.text
        result = response.json()["data"]["result"]
        assert result["exit_code"] == -1 and result["error"].startswith("exec "), result
        created = await http.post(f"/v1/sandboxes/{sandbox}/processes", content=raw,
                                  headers={"Content-Type": "application/json"})
        assert created.status_code == 400, created.text
        await still_serves(http, sandbox)


async def test_absurd_disk_size(http: httpx.AsyncClient) -> None:
    for disk_mib in (MAX_DISK_MIB + 1, 2**62, 2**80):
        response = await http.post("/v1/sandboxes", json={"shape": "s-1vcpu-512mb", "disk_mib": disk_mib})
        assert "disk_mib must be at most" in fail(response, 400, "invalid_disk_mib")
    assert (await http.get("/v1/sandboxes")).status_code == 200


async def test_upload_larger_than_the_disk(http: httpx.AsyncClient, sandbox: str) -> None:
    too_big = (DISK_MIB + 16) * 1024 * 1024
    # Announced: refused before a byte is read.
    response = await http.put(f"/v1/sandboxes/{sandbox}/files", params={"path": "/workspace/big"},
                              content=b"\0" * too_big)
    assert "do not fit the sandbox's 64 MiB disk" in fail(response, 413, "disk_full")
    await still_serves(http, sandbox)

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: the disk itself says no
        block = b"z" * (1024 * 1024)
        for _ in range(DISK_MIB + 16):
            yield block

    view = (await http.get(f"/v1/sandboxes/{sandbox}")).json()["data"]
    if "ext4" not in (view.get("limits") or ""):
        pytest.skip("this engine cannot cap disks (needs root and loop devices)")
    response = await http.put(f"/v1/sandboxes/{sandbox}/files", params={"path": "/workspace/big"},
                              content=chunks())
    assert "No space left on device" in fail(response, 413, "disk_full")
    await still_serves(http, sandbox)
    # The disk was really filled (the attack ran), and the sandbox can free it again.
    used = await http.post(f"/v1/sandboxes/{sandbox}/exec", json={
        "cmd": "sh", "args": ["-c", "du -m /workspace/big | cut -f1; rm /workspace/big"]})
    assert int(used.json()["data"]["result"]["stdout"]) >= DISK_MIB - 16


async def test_a_body_nested_past_the_parsers_depth(http: httpx.AsyncClient, sandbox: str) -> None:
    """JSON nested deeper than Python's parser goes: refused as bad input, on every route
    with a body, including the process-input shortcut that parses its own."""
    deep = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(RecursionError):
        json.loads(deep)
    created = await http.post(f"/v1/sandboxes/{sandbox}/processes", json={"cmd": "cat"})
    assert created.status_code == 200, created.text
    process_id = created.json()["data"]["process_id"]
    for path in (f"/v1/sandboxes/{sandbox}/processes/{process_id}/input", f"/v1/sandboxes/{sandbox}/exec",
                 "/v1/sandboxes"):
        response = await http.post(path, content=deep, headers={"Content-Type": "application/json"})
        assert 400 <= response.status_code < 500, (path, response.status_code, response.text[:200])
        assert response.json()["status"] == "fail"
        await still_serves(http, sandbox)
