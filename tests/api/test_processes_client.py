"""The kernel's own API client (sandbox_kernel.api) over managed processes and exec
stdin/env, against the real local engine: the calls the runner channel is built on."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from engine_helpers import wait_status
from sandbox_kernel.api import (
    ConflictError,
    CreateProcessRequest,
    ManagedProcess,
    NotFoundError,
    ProcessFrame,
    ProcessFrameType,
    ProcessKind,
    ProcessStream,
    PtySize,
    SandboxClient,
    SandboxStatus,
)
from sandbox_kernel.api.models import CreateSandboxRequest


@pytest.fixture
async def sandbox_id(client: SandboxClient) -> AsyncIterator[str]:
    created = await client.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-512mb"))
    yield created.id
    await client.delete_sandbox(created.id)


async def frames_until(stream: ProcessStream, marker: bytes) -> tuple[bytes, list[ProcessFrame]]:
    data, seen = b"", []
    async for frame in stream:
        seen.append(frame)
        data += frame.data
        if marker in data or frame.type == ProcessFrameType.EXIT:
            break
    return data, seen


async def test_exec_stdin_and_env(client: SandboxClient, sandbox_id: str) -> None:
    result = (await client.exec(sandbox_id, "sh", ["-c", "cat; echo $X"], stdin="in\n", env={"X": "y"})).result
    assert result.stdout == "in\ny\n"
    async with client.exec_stream(sandbox_id, "cat", stdin="streamed") as frames:
        assert "".join([f.stdout or "" async for f in frames]) == "streamed"


async def test_channel_calls(client: SandboxClient, sandbox_id: str) -> None:
    code = "import sys\nfor line in sys.stdin: print('ok', line.strip(), flush=True)"
    process = await client.create_process(sandbox_id, CreateProcessRequest(cmd="python3", args=["-u", "-c", code]))
    assert isinstance(process, ManagedProcess) and process.kind == ProcessKind.PROCESS
    pid = process.process_id
    assert await client.process_input(sandbox_id, pid, b"a\n") == 1
    async with client.connect_process(sandbox_id, pid) as stream:
        data, seen = await frames_until(stream, b"ok a\n")
    assert data == b"ok a\n"
    assert await client.process_input(sandbox_id, pid, b"b\n") == 2
    async with client.connect_process(sandbox_id, pid, after=seen[-1].seq or 0) as stream:
        data, _ = await frames_until(stream, b"ok b\n")
    assert data == b"ok b\n"  # nothing replayed twice
    assert [p.process_id for p in await client.list_processes(sandbox_id)] == [pid]
    await client.close_process_stdin(sandbox_id, pid)
    finished = await client.wait_process(sandbox_id, pid, scope="tree", timeout_ms=20_000)
    assert finished.tree_exited and finished.exit_code == 0
    with pytest.raises(ConflictError):
        await client.process_input(sandbox_id, pid, b"late\n")
    with pytest.raises(NotFoundError) as missing:
        await client.get_process(sandbox_id, "proc-missing")
    assert missing.value.code == "process_not_found"  # not a provider without the route


async def test_signal_resize_kill(client: SandboxClient, sandbox_id: str) -> None:
    shell = await client.create_process(sandbox_id, CreateProcessRequest(pty=PtySize(rows=10, cols=20)))
    await client.resize_process(sandbox_id, shell.process_id, 11, 33)
    await client.process_input(sandbox_id, shell.process_id, b"stty size\n")
    async with client.connect_process(sandbox_id, shell.process_id) as stream:
        data, _ = await frames_until(stream, b"11 33")
    assert b"11 33" in data
    killed = await client.kill_process(sandbox_id, shell.process_id, grace_ms=100)
    assert killed.tree_exited
    sleeper = await client.create_process(sandbox_id, CreateProcessRequest(cmd="sleep", args=["300"]))
    await client.signal_process(sandbox_id, sleeper.process_id, "SIGTERM")
    ended = await client.wait_process(sandbox_id, sleeper.process_id, timeout_ms=20_000)
    assert ended.signal == "SIGTERM" and ended.exit_code == 143


async def test_heartbeats_while_paused(client: SandboxClient, sandbox_id: str) -> None:
    process = await client.create_process(sandbox_id, CreateProcessRequest(cmd="sleep", args=["300"]))
    async with client.connect_process(sandbox_id, process.process_id, timeout=30) as stream:
        await client.pause_sandbox(sandbox_id)
        await wait_status(client, sandbox_id, SandboxStatus.PAUSED)
        frame = await asyncio.wait_for(stream.__aiter__().__anext__(), 30)  # the engine's, 5 s
        assert frame.type == ProcessFrameType.HEARTBEAT
    with pytest.raises(ConflictError):  # a paused sandbox's agent cannot answer
        await client.get_process(sandbox_id, process.process_id)
    await client.resume_sandbox(sandbox_id)
    await wait_status(client, sandbox_id, SandboxStatus.RUNNING)
    assert (await client.get_process(sandbox_id, process.process_id)).state == "running"


async def test_large_input_refused_cleanly(client: SandboxClient, sandbox_id: str) -> None:
    """A refusal comes before the agent read the input: it still answers 409, not a broken pipe."""
    process = await client.create_process(sandbox_id, CreateProcessRequest(cmd="true"))
    await client.wait_process(sandbox_id, process.process_id, scope="tree", timeout_ms=20_000)
    with pytest.raises(ConflictError):
        await client.process_input(sandbox_id, process.process_id, b"x" * (4 << 20))
    with pytest.raises(NotFoundError):
        await client.process_input(sandbox_id, "proc-missing", b"x" * (4 << 20))
