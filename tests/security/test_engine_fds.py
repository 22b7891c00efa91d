"""Sandboxes cannot exhaust the engine's file descriptors (issue 12, item 4).

Three sandboxes each open 600 connections to their egress proxy port and say nothing:
before, each one cost the engine a descriptor, 1,800 in all, past the common soft limit
of 1024 the engine started with, and other sandboxes' execs and new sandboxes failed.
Now the engine takes at most MAX_STREAMS connections per sandbox, ends handshakes that say
nothing, raises its own soft limit to its hard one, and gives sandboxes a lower one.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from attack_helpers import ONCE
from engine_helpers import running_engine
from sandbox_kernel.api import CreateSandboxRequest, SandboxClient
from sandbox_kernel.local.egress_gate import MAX_STREAMS
from sandbox_kernel.local.engine import SANDBOX_NOFILE
from sandbox_kernel.local.service import EngineEndpoint

pytestmark = [pytest.mark.slow, ONCE]

ATTACKERS = 3
CONNECTIONS = 600
COMMON_SOFT_LIMIT = 1024

HOG = f'''
import json, resource, socket, time
limits = resource.getrlimit(resource.RLIMIT_NOFILE)
held = []
for _ in range({CONNECTIONS}):
    held.append(socket.create_connection(("127.0.0.1", 3128), timeout=10))
print(json.dumps({{"held": len(held), "limits": limits}}), flush=True)
time.sleep(30)
'''


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineEndpoint]:
    """An engine of its own, started with the common soft limit of 1024 open files."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(COMMON_SOFT_LIMIT, hard), hard))
    try:
        with running_engine(Path(tmp_path_factory.mktemp("fds"))) as endpoint:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            yield endpoint
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def open_files_limit(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise LookupError("no open files limit")


def engine_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def hog(client: SandboxClient, sandbox: str, reports: list[dict]) -> None:
    async with client.exec_stream(sandbox, "python3", ["-c", HOG]) as frames:
        async for frame in frames:
            if frame.stdout:
                reports.append(json.loads(frame.stdout))
                return


async def test_sandboxes_cannot_exhaust_the_engines_descriptors(engine: EngineEndpoint) -> None:
    soft, hard = open_files_limit(engine.pid)
    assert soft == hard  # raised from 1024 at start
    peak = 0
    sampling = True

    def sample() -> None:
        nonlocal peak
        while sampling:
            peak = max(peak, engine_fds(engine.pid))
            time.sleep(0.005)

    async with SandboxClient(engine.url, engine.token, timeout=120) as client:
        victim = (await client.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-512mb"))).id
        attackers = [(await client.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-512mb"))).id
                     for _ in range(ATTACKERS)]
        before = engine_fds(engine.pid)
        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            reports: list[dict] = []
            await asyncio.gather(*(hog(client, sandbox, reports) for sandbox in attackers))
            # The attack ran: every connection was made, in sandboxes limited to SANDBOX_NOFILE.
            assert [r["held"] for r in reports] == [CONNECTIONS] * ATTACKERS
            assert all(tuple(r["limits"]) == tuple(min(v, hard) for v in SANDBOX_NOFILE) for r in reports)
            # Meanwhile another notebook's sandbox works, and new sandboxes can be made.
            echoed = await client.exec(victim, "echo", ["still here"])
            assert echoed.result.stdout == "still here\n"
            extra = await client.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-512mb"))
            await client.delete_sandbox(extra.id)
        finally:
            sampling = False
            sampler.join()
        print(f"engine descriptors: {before} before, peak {peak} during "
              f"{ATTACKERS} x {CONNECTIONS} idle proxy connections (limit {soft})")
        # Each sandbox got at most MAX_STREAMS connections, each holding at most two of the
        # engine's descriptors (its agent connection and, while that one opens, the
        # directory it is opened through, or later its upstream), plus the few a create and
        # the execs take: under the 1024 the engine started with, where 1,800 were asked for.
        assert peak - before <= ATTACKERS * MAX_STREAMS * 2 + 32
        assert peak < COMMON_SOFT_LIMIT
        for sandbox in (victim, *attackers):
            await client.delete_sandbox(sandbox)
