"""The warm pool: kernels start on pre-made sandboxes, never share one, and the pool refills.

Real kernels, a real engine, real sandboxes. The pool's bookkeeping is read from the state
dir, as `sandbox-kernel ls` does.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from engine_helpers import sandbox_pids, sandbox_status, wait_status
from kernel_helpers import execute, running_kernel
from sandbox_kernel.sandbox import pool
from sandbox_kernel.api import CreateSandboxRequest, SandboxClient, SandboxStatus
from sandbox_kernel.config import ENV_VARS, ConfigError, Settings
from sandbox_kernel.sandbox.runner_setup import RUNNER_DIR
from sandbox_kernel.local.service import EngineEndpoint
from cli_helpers import cli

POOL_SIZE = 2
SANDBOX_ID = "import os\nprint(os.environ['SANDBOX_ID'])"


def wait_full(warm: pool.WarmPool, timeout: float = 120.0) -> set[str]:
    deadline = time.monotonic() + timeout
    while len(warm.members()) < warm.size:
        assert time.monotonic() < deadline, f"pool never refilled: {warm.members()}"
        time.sleep(0.2)
    return set(warm.members())


def destroy_all(engine: EngineEndpoint, sandbox_ids: set[str]) -> None:
    async def destroy() -> None:
        async with SandboxClient(engine.url, engine.token) as client:
            for sandbox_id in sandbox_ids:
                await client.delete_sandbox(sandbox_id)

    asyncio.run(destroy())
    for sandbox_id in sandbox_ids:
        pool.forget(sandbox_id)


def start_and_report_sandbox(kernelspec: str) -> tuple[str, object]:
    """Start a kernel and return the id of the sandbox it runs cells in (kernel kept open)."""
    context = running_kernel(kernelspec)
    _, kc = context.__enter__()
    return execute(kc, SANDBOX_ID).text().strip(), context


@pytest.mark.slow
def test_kernels_start_on_pooled_sandboxes_never_the_same_one_and_the_pool_refills(
        kernelspec: str, engine: EngineEndpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VARS["warm_pool"], str(POOL_SIZE))
    warm = pool.WarmPool.for_settings(Settings.from_env(), POOL_SIZE)
    pooled: set[str] = set()
    contexts = []
    try:
        with running_kernel(kernelspec) as (_, first):  # an empty pool: a cold start, then a top-up
            execute(first, "1")
            pooled = wait_full(warm)
            listed = cli("ls").stdout
            assert all(f"{sandbox_id}" in line and line.endswith("owner: warm pool")
                       for sandbox_id in pooled for line in listed.splitlines() if line.startswith(sandbox_id))
            dry_run = cli("gc", "--dry-run").stdout
            assert not any(sandbox_id in dry_run for sandbox_id in pooled)  # members are not orphans
        # Two kernels at once: each gets a pooled sandbox of its own.
        with ThreadPoolExecutor(2) as threads:
            started = list(threads.map(start_and_report_sandbox, [kernelspec, kernelspec]))
        contexts = [context for _, context in started]
        claimed = {sandbox_id for sandbox_id, _ in started}
        assert len(claimed) == 2 and claimed == pooled
        refilled = wait_full(warm)
        assert not refilled & claimed
        assert all(sandbox_status(engine, s) == SandboxStatus.RUNNING for s in refilled)
        pooled = refilled
    finally:
        for context in contexts:
            context.__exit__(None, None, None)
        destroy_all(engine, pooled)
    assert all(sandbox_status(engine, s) in (SandboxStatus.DESTROYED, None) for s in claimed)


@pytest.mark.slow
def test_a_pooled_sandbox_whose_runner_died_gets_a_new_one_when_a_kernel_takes_it(
        kernelspec: str, engine: EngineEndpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel's early start claims a pooled sandbox without asking its runner (an exec there
    started one more Python while the kernel imported); the kernel asks over the channel it
    opens, and where no runner answers (this one was killed while pooled) it starts one."""
    monkeypatch.setenv(ENV_VARS["warm_pool"], "1")
    warm = pool.WarmPool.for_settings(Settings.from_env(), 1)
    pooled: set[str] = set()
    try:
        with running_kernel(kernelspec) as (_, first):
            execute(first, "1")
            pooled = wait_full(warm)
        [member] = pooled

        async def running() -> None:  # a member pauses itself when idle: killing needs it thawed
            async with SandboxClient(engine.url, engine.token) as client:
                if (await client.get_sandbox(member)).status != SandboxStatus.RUNNING:
                    await client.resume_sandbox(member)
                    await wait_status(client, member, SandboxStatus.RUNNING)

        asyncio.run(running())
        [daemon] = sandbox_pids(member, needle=b"serve\0" + RUNNER_DIR.encode())
        os.kill(daemon, signal.SIGKILL)
        with running_kernel(kernelspec) as (_, kc):
            result = execute(kc, SANDBOX_ID + "\nx = 6 * 7")
            assert result.reply["content"]["status"] == "ok", result.text("stderr")
            assert result.text() == f"{member}\n", "the pooled sandbox was taken"
            assert execute(kc, "print(x)").text() == "42\n"
            pooled = wait_full(warm)
    finally:
        destroy_all(engine, pooled)


def test_gc_keeps_fresh_pool_members_and_destroys_stale_ones(engine: EngineEndpoint) -> None:
    warm = pool.WarmPool.for_settings(Settings(provider="local", shape="s-1vcpu-256mb"), 2)

    async def fill() -> int:
        async with SandboxClient(engine.url, engine.token) as client:
            async def make() -> str:
                return (await client.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-256mb"))).id
            return await warm.refill(make)

    assert asyncio.run(fill()) == 2 and asyncio.run(fill()) == 0  # full: nothing more made
    fresh, old = warm.members()
    record = warm.root / "members" / f"{old}.json"
    record.write_text(json.dumps({"created": time.time() - pool.MAX_AGE - 60}))
    try:
        collected = cli("gc").stdout.splitlines()  # other tests' orphans may go too
        assert f"{old}: stale warm pool member, destroyed" in collected
        assert not any(fresh in line for line in collected)
        assert sandbox_status(engine, old) == SandboxStatus.DESTROYED
        assert sandbox_status(engine, fresh) == SandboxStatus.RUNNING and warm.members() == [fresh]
    finally:
        destroy_all(engine, {fresh})
    # A record whose sandbox is gone is dropped by the next gc.
    (warm.root / "members" / f"{fresh}.json").write_text(json.dumps({"created": time.time() - 60}))
    cli("gc")
    assert warm.members() == []


def test_the_option_and_the_configuration_key() -> None:
    assert Settings.from_env(env={}).warm_pool == 0
    assert Settings.from_env(env={"SANDBOX_KERNEL_WARM_POOL": "2"}, kernel_args={"warm_pool": "3"}).warm_pool == 3
    for bad in ("-1", "33", "two"):
        with pytest.raises(ConfigError, match="SANDBOX_KERNEL_WARM_POOL must be a whole number from 0 to 32"):
            Settings.from_env(env={"SANDBOX_KERNEL_WARM_POOL": bad})
    base = Settings(provider="local")
    assert pool.pool_key(base) == pool.pool_key(Settings(provider="local", warm_pool=4))
    variants = [Settings(provider="local", shape="s-2vcpu-4gb"), Settings(provider="local", rootfs="other"),
                Settings(provider="local", egress=["index.example.com"]), Settings(provider="local", egress=[]),
                Settings(provider="createos", api_key="k1"), Settings(provider="createos", api_key="k2")]
    keys = {pool.pool_key(settings) for settings in [base, *variants]}
    assert len(keys) == len(variants) + 1


def test_each_python_environment_has_its_own_pool(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Each environment's kernels use their own engine: a member another environment's
    engine made is unknown to this one's, so it must not be offered to this kernel."""
    here = pool.pool_key(Settings(provider="local"))
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    assert pool.pool_key(Settings(provider="local")) != here
