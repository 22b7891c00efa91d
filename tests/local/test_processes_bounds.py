"""Nothing a managed process writes grows the engine's memory, nor the agent's past its
window: 300 MiB written with nobody connected, then with a reader too slow to keep up."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from createos import Client
from createos.instance import SandboxInstance
from createos.models import (
    CreateSandboxRequest,
    ManagedProcessConnectOptions,
    ManagedProcessCreateRequest,
    ManagedProcessWaitOptions,
    ManagedProcessWaitScope,
)

from engine_helpers import agent_pid
from sandbox_kernel.guest.agent.processes import READ_CHUNK, WINDOW_BYTES
from sandbox_kernel.local.service import EngineEndpoint

MIB = 1 << 20
# 300 MiB of incompressible output, as fast as the process can write it.
FLOOD = ("import os, sys\nblock = os.urandom(1 << 16)\nwrite = sys.stdout.buffer.write\n"
         "for _ in range(4800): write(block)")
ENGINE_GROWTH_BOUND = 32 * MIB  # frames in flight to one client: 3 x ~350 KiB, plus buffers
AGENT_GROWTH_BOUND = 32 * MIB  # the 8 MiB window, plus allocator slack


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


@pytest.fixture(scope="module")
def sandbox(engine: EngineEndpoint) -> Iterator[SandboxInstance]:
    client = Client(api_key=engine.token, base_url=engine.url)
    box = client.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-1gb"))
    yield box
    box.destroy()
    client.close()


def finish(sandbox: SandboxInstance, process_id: str) -> None:
    waited = sandbox.processes.wait(process_id, ManagedProcessWaitOptions(
        scope=ManagedProcessWaitScope.TREE, wait_timeout=120, timeout=180))
    assert waited.tree_exited and waited.exit_code == 0


def test_flood_with_nobody_connected(engine: EngineEndpoint, sandbox: SandboxInstance) -> None:
    agent = agent_pid(sandbox.id)
    engine_before, agent_before = rss(engine.pid), rss(agent)
    started = sandbox.processes.create(ManagedProcessCreateRequest(command="python3", arguments=["-c", FLOOD]))
    finish(sandbox, started.process_id)
    window = sandbox.processes.get(started.process_id).output
    assert window.bytes <= WINDOW_BYTES and window.newest_sequence >= 300 * MIB // READ_CHUNK  # every chunk read
    assert rss(engine.pid) - engine_before < ENGINE_GROWTH_BOUND
    assert rss(agent) - agent_before < AGENT_GROWTH_BOUND


def test_flood_with_a_slow_reader(engine: EngineEndpoint, sandbox: SandboxInstance) -> None:
    agent = agent_pid(sandbox.id)
    engine_before, agent_before = rss(engine.pid), rss(agent)
    started = sandbox.processes.create(ManagedProcessCreateRequest(command="python3", arguments=["-c", FLOOD]))
    received, gaps, last = 0, [], 0
    with sandbox.processes.connect(started.process_id, ManagedProcessConnectOptions(timeout=180)) as stream:
        for event in stream:
            if event.type != "data":
                break
            if event.oldest_available_sequence:
                gaps.append((last, event.oldest_available_sequence))
            assert event.sequence > last
            last = event.sequence
            received += len(event.data)
            time.sleep(0.02)  # far slower than the writer
            peak_engine = rss(engine.pid)
            assert peak_engine - engine_before < ENGINE_GROWTH_BOUND
    assert event.type == "exit" and event.exit_code == 0
    assert gaps and all(oldest > seen + 1 for seen, oldest in gaps)  # skipped ahead, and said so
    assert received < 300 * MIB
    finish(sandbox, started.process_id)
    assert rss(agent) - agent_before < AGENT_GROWTH_BOUND
