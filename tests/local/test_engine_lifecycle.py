"""Pause, resume, PATCH and auto-pause on the real local engine, with real sandboxes.

CPU use is read from the host's /proc: a paused sandbox's processes must not get a single
clock tick. Every freezer this host supports is exercised (each in its own engine).
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import datetime
import glob
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from sandbox_kernel.api import (
    BadRequestError,
    ConflictError,
    CreateSandboxRequest,
    NotFoundError,
    SandboxClient,
    SandboxStatus,
)
from sandbox_kernel.api.models import PatchSandboxRequest
from sandbox_kernel.local.service import EngineEndpoint

from engine_helpers import cpu_ticks, freezer_available, running_engine, sandbox_pids, wait_status

pytestmark = pytest.mark.slow

SHAPE = "s-1vcpu-512mb"
BURN = "nohup python3 -c 'while True: pass' >/dev/null 2>&1 &"


# -- helpers ------------------------------------------------------------------------------


def cgroup_dirs(sandbox_id: str) -> list[str]:
    return glob.glob(f"/sys/fs/cgroup/**/{sandbox_id}", recursive=True)


async def freezer_of(endpoint: EngineEndpoint) -> str:
    async with httpx.AsyncClient(base_url=endpoint.url, headers={"X-Api-Key": endpoint.token}) as raw:
        return (await raw.get("/v1/whoami")).json()["data"]["engine"]["freezer"]


@contextlib.contextmanager
def extra_engine(tmp_path: Path, freezer: str) -> Iterator[EngineEndpoint]:
    """A second engine (own state dir) with SANDBOX_KERNEL_FREEZER set."""
    state = tmp_path / f"state-{freezer}"
    state.mkdir()
    with running_engine(state, SANDBOX_KERNEL_FREEZER=freezer, SANDBOX_KERNEL_STATE_DIR=str(state)) as endpoint:
        yield endpoint


@pytest.fixture
async def sandbox(client: SandboxClient) -> AsyncIterator[str]:
    created = await client.create_sandbox(CreateSandboxRequest(shape=SHAPE))
    yield created.id
    with contextlib.suppress(Exception):
        await client.delete_sandbox(created.id)


# -- pause and resume ---------------------------------------------------------------------


async def test_pause_resume_keeps_state(client: SandboxClient, sandbox: str, engine: EngineEndpoint,
                                        state_dir: Path) -> None:
    await client.upload_file(sandbox, "/workspace/note.txt", b"before the pause")
    counter = "i=0; while true; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.05; done"
    await client.exec(sandbox, "sh", ["-c", f"nohup sh -c '{counter}' >/dev/null 2>&1 &"])
    # read from the host, through a sandbox process's root (its disk may be mounted only there)
    host_counter = Path(f"/proc/{sandbox_pids(sandbox)[0]}/root/tmp/counter")

    def count() -> int:
        for _ in range(50):  # the file is rewritten constantly: retry a torn read
            with contextlib.suppress(ValueError):
                return int(host_counter.read_text())
            time.sleep(0.01)
        raise AssertionError("counter unreadable")

    await asyncio.sleep(0.3)
    assert count() > 0

    answered = await client.pause_sandbox(sandbox)
    assert answered.status in (SandboxStatus.PAUSING, SandboxStatus.PAUSED)
    seen, view = await wait_status(client, sandbox, SandboxStatus.PAUSED)
    assert set(seen) <= {SandboxStatus.PAUSING, SandboxStatus.PAUSED}
    assert view.paused_at and view.last_resumed_at is None

    frozen_at = count()
    await asyncio.sleep(0.5)
    assert count() == frozen_at, "the sandbox kept running while paused"
    with pytest.raises(ConflictError) as caught:
        await client.exec(sandbox, "true")
    assert "sandbox is paused" in caught.value.user_message()
    with pytest.raises(ConflictError):
        await client.download_file(sandbox, "/workspace/note.txt")
    with pytest.raises(ConflictError):
        await client.pause_sandbox(sandbox)

    answered = await client.resume_sandbox(sandbox)
    assert answered.status in (SandboxStatus.RESUMING, SandboxStatus.RUNNING)
    seen, view = await wait_status(client, sandbox, SandboxStatus.RUNNING)
    assert view.last_resumed_at and view.paused_at
    with pytest.raises(ConflictError):
        await client.resume_sandbox(sandbox)

    assert await client.download_file(sandbox, "/workspace/note.txt") == b"before the pause"
    await asyncio.sleep(0.5)
    assert count() > frozen_at, "the background process did not continue after resume"
    echoed = await client.exec(sandbox, "cat", ["/tmp/counter"])
    assert int(echoed.result.stdout) >= frozen_at


async def test_invalid_transitions_and_unknown_ids(client: SandboxClient, sandbox: str,
                                                   engine: EngineEndpoint) -> None:
    with pytest.raises(ConflictError):
        await client.resume_sandbox(sandbox)  # running, not paused
    for call in (client.pause_sandbox, client.resume_sandbox):
        with pytest.raises(NotFoundError):
            await call("sb-does-not-exist")
    with pytest.raises(NotFoundError):
        await client.patch_sandbox("sb-does-not-exist", PatchSandboxRequest(disable_auto_pause=True))
    # While pausing is in flight, a second pause or a resume is a conflict too.
    await client.pause_sandbox(sandbox)
    async with httpx.AsyncClient(base_url=engine.url, headers={"X-Api-Key": engine.token}) as raw:
        again = await raw.post(f"/v1/sandboxes/{sandbox}/pause")
        assert again.status_code == 409
        assert again.json()["status"] == "fail" and "only a running sandbox" in again.json()["data"]["message"]
    await wait_status(client, sandbox, SandboxStatus.PAUSED)


async def test_destroy_paused_leaves_nothing_behind(client: SandboxClient, engine: EngineEndpoint) -> None:
    created = await client.create_sandbox(CreateSandboxRequest(shape=SHAPE))
    await client.exec(created.id, "sh", ["-c", "nohup sleep 600 >/dev/null 2>&1 &"])
    assert sandbox_pids(created.id)
    cgroup_based = (await freezer_of(engine)).startswith("cgroup")
    if cgroup_based:
        assert cgroup_dirs(created.id), "the sandbox should have its own cgroup"
    await client.pause_sandbox(created.id)
    await wait_status(client, created.id, SandboxStatus.PAUSED)
    gone = await client.delete_sandbox(created.id)
    assert gone.status == SandboxStatus.DESTROYED
    assert (await client.get_sandbox(created.id)).status == SandboxStatus.DESTROYED
    deadline = time.monotonic() + 5
    while sandbox_pids(created.id) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert sandbox_pids(created.id) == []
    assert cgroup_dirs(created.id) == []


# -- CPU while paused, for every freezer ----------------------------------------------------


async def check_no_cpu_while_paused(endpoint: EngineEndpoint) -> None:
    async with SandboxClient(endpoint.url, endpoint.token) as client:
        created = await client.create_sandbox(CreateSandboxRequest(shape=SHAPE))
        try:
            await client.exec(created.id, "sh", ["-c", BURN])
            deadline = time.monotonic() + 10
            while not (burners := sandbox_pids(created.id, b"while True")):
                assert time.monotonic() < deadline, "the CPU burner did not start"
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)
            start = cpu_ticks(burners)
            await asyncio.sleep(0.5)
            assert cpu_ticks(burners) > start, "the burner should burn while running"

            await client.pause_sandbox(created.id)
            await wait_status(client, created.id, SandboxStatus.PAUSED)
            paused = cpu_ticks(burners)
            await asyncio.sleep(1.0)
            assert cpu_ticks(burners) == paused, "a paused sandbox used CPU"

            await client.resume_sandbox(created.id)
            await wait_status(client, created.id, SandboxStatus.RUNNING)
            resumed = cpu_ticks(burners)
            deadline = time.monotonic() + 30  # on a loaded host the burner's next tick may be a while
            while cpu_ticks(burners) == resumed:
                assert time.monotonic() < deadline, "the burner did not run again after resume"
                await asyncio.sleep(0.1)
        finally:
            await client.delete_sandbox(created.id)
        assert sandbox_pids(created.id) == []
        assert cgroup_dirs(created.id) == []


async def test_paused_sandbox_uses_no_cpu_default_freezer(engine: EngineEndpoint) -> None:
    await check_no_cpu_while_paused(engine)


@pytest.mark.parametrize("name", ["signal", "cgroup-v1", "cgroup-v2"])
async def test_paused_sandbox_uses_no_cpu(name: str, tmp_path: Path) -> None:
    why_not = freezer_available(name)
    if why_not:
        pytest.skip(f"{name} freezer not available on this host: {why_not}")
    with extra_engine(tmp_path, name) as endpoint:
        described = await freezer_of(endpoint)
        assert described.startswith({"signal": "SIGSTOP", "cgroup-v1": "cgroup v1",
                                     "cgroup-v2": "cgroup v2"}[name]), described
        await check_no_cpu_while_paused(endpoint)


# -- PATCH --------------------------------------------------------------------------------


async def test_patch_auto_pause_and_ingress(client: SandboxClient, sandbox: str,
                                            engine: EngineEndpoint) -> None:
    view = await client.patch_sandbox(sandbox, PatchSandboxRequest(auto_pause_after_seconds=120))
    assert view.id == sandbox and view.auto_pause_after_seconds == 120
    assert (await client.get_sandbox(sandbox)).auto_pause_after_seconds == 120
    view = await client.patch_sandbox(sandbox, PatchSandboxRequest(ingress_enabled=False))
    assert view.auto_pause_after_seconds == 120 and view.ingress_enabled is False  # omitted = unchanged
    view = await client.patch_sandbox(sandbox, PatchSandboxRequest(disable_auto_pause=True))
    assert view.auto_pause_after_seconds is None
    for bad in (30, 86401):
        unchecked = PatchSandboxRequest()
        unchecked.auto_pause_after_seconds = bad  # past the client-side check: the server says 400
        with pytest.raises(BadRequestError):
            await client.patch_sandbox(sandbox, unchecked)
    with pytest.raises(BadRequestError) as caught:
        await client.patch_sandbox(sandbox, PatchSandboxRequest(ingress_enabled=True))
    assert "ingress is not supported by the local engine" in caught.value.user_message()
    async with httpx.AsyncClient(base_url=engine.url, headers={"X-Api-Key": engine.token}) as raw:
        answer = await raw.patch(f"/v1/sandboxes/{sandbox}", json={"auto_pause_after_seconds": 59})
        assert answer.status_code == 400 and answer.json()["status"] == "fail"


# -- auto-pause ---------------------------------------------------------------------------


# One second of auto-pause lasts this long on the auto-pause test's engine (the API's
# minimum is 60 s: the test would wait out more than a minute of the suite's time budget).
SECOND = 0.1


@pytest.fixture
async def fast_auto_pause_client(tmp_path: Path) -> AsyncIterator[SandboxClient]:
    with running_engine(tmp_path, SANDBOX_KERNEL_AUTO_PAUSE_SECOND=str(SECOND)) as endpoint:
        async with SandboxClient(endpoint.url, endpoint.token) as api:
            yield api


async def test_auto_pause_pauses_idle_but_not_a_long_exec(fast_auto_pause_client: SandboxClient) -> None:
    """Two sandboxes with 60 s auto-pause, side by side: one idle, one streaming a `sleep`
    of 100 s (on an engine whose seconds last SECOND each)."""
    client = fast_auto_pause_client
    request = CreateSandboxRequest(shape=SHAPE, auto_pause_after_seconds=60)
    idle = await client.create_sandbox(request)
    busy = await client.create_sandbox(request)
    started = time.monotonic()
    idle_paused_after: float | None = None
    try:
        assert (await client.get_sandbox(idle.id)).auto_pause_after_seconds == 60
        exit_code = None
        async with client.exec_stream(busy.id, "sleep", [str(100 * SECOND)]) as frames:

            async def watch() -> None:
                nonlocal idle_paused_after
                while True:
                    await asyncio.sleep(SECOND)
                    if idle_paused_after is None:
                        if (await client.get_sandbox(idle.id)).status == SandboxStatus.PAUSED:
                            idle_paused_after = time.monotonic() - started
                    status = (await client.get_sandbox(busy.id)).status
                    assert status == SandboxStatus.RUNNING, f"busy sandbox {status.value} during its exec"

            watcher = asyncio.get_running_loop().create_task(watch())
            try:
                async for frame in frames:
                    if frame.exit_code is not None:
                        exit_code = frame.exit_code
                    if watcher.done():
                        break
            finally:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
        assert exit_code == 0
        assert idle_paused_after is not None, "the idle sandbox was not auto-paused within 100 (engine) s"
        # Early pausing is judged on the engine's own clock: the idle timer starts at create,
        # which this test's clock sees only after the request returned (and a second create).
        view = await client.get_sandbox(idle.id)
        assert view.paused_at
        idle_for = datetime.fromisoformat(view.paused_at) - datetime.fromisoformat(view.created_at)
        assert idle_for.total_seconds() >= 60 * SECOND, f"paused after {idle_for} idle"
    finally:
        for sandbox_id in (idle.id, busy.id):
            with contextlib.suppress(Exception):
                await client.delete_sandbox(sandbox_id)
