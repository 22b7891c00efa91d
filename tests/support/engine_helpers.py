"""Helpers for tests that talk to real local engines: start one, find a sandbox's
processes on the host, wait for a status."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sandbox_kernel.api import NotFoundError, SandboxAPIError, SandboxClient, SandboxStatus
from sandbox_kernel.local import freezer as freezers
from sandbox_kernel.local.registry import start_time
from sandbox_kernel.local.service import EngineEndpoint, read_endpoint
from sandbox_kernel.paths import state_dir


@contextlib.contextmanager
def running_engine(state: Path, **env: str) -> Iterator[EngineEndpoint]:
    """`sandbox-kernel serve` in a subprocess with its own state dir (and extra env). Every
    sandbox on the state dir is destroyed after the test, even one whose engine it stopped."""
    process, endpoint = start_engine(state, env)
    try:
        yield endpoint
    finally:
        if not destroy_every_sandbox(endpoint):
            # The test stopped the engine (or is stopping it). Its sandboxes run on, left to
            # the next engine: only an engine on this state dir can take them over and end them.
            stop_process(process, 15)
            process, endpoint = start_engine(state, env)
            destroy_every_sandbox(endpoint)
        stop_process(process, 15)


def start_engine(state: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], EngineEndpoint]:
    with open(state / "engine.log", "ab") as log:  # the engine keeps its own copy of the descriptor
        process = subprocess.Popen(
            [sys.executable, "-m", "sandbox_kernel", "serve", "--state-dir", str(state)],
            stdout=log, stderr=log, start_new_session=True, env={**os.environ, **env})
    deadline = time.monotonic() + 30
    endpoint = None
    while endpoint is None and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.05)
        endpoint = read_endpoint(state)
    if endpoint is None:
        stop_process(process, 15)
        pytest.fail("local engine did not start: " + (state / "engine.log").read_text()[-2000:])
    return process, endpoint


def destroy_every_sandbox(endpoint: EngineEndpoint) -> bool:
    """False if the engine could not be asked (it is gone or going)."""
    async def destroy() -> None:
        async with SandboxClient(endpoint.url, endpoint.token) as api:
            for view in await api.list_sandboxes():
                with contextlib.suppress(NotFoundError):
                    await api.delete_sandbox(view.id)
    # In a thread of its own: the caller may be inside an event loop (an async test).
    with ThreadPoolExecutor(1) as thread:
        try:
            thread.submit(asyncio.run, destroy()).result()
        except (SandboxAPIError, OSError):
            return False
    return True


def sandbox_pids(sandbox_id: str, needle: bytes = b"") -> list[int]:
    """Host pids of the sandbox's processes (each has SANDBOX_ID=<id> in its environment)."""
    marker = f"SANDBOX_ID={sandbox_id}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            environ = Path(entry.path, "environ").read_bytes()
            cmdline = Path(entry.path, "cmdline").read_bytes()
        except OSError:
            continue
        if marker in environ.split(b"\0") and needle in cmdline:
            found.append(int(entry.name))
    return found


def sandbox_tree(state: Path, sandbox_id: str) -> list[int]:
    """The sandbox's bwrap process (from the engine's record of it) and its descendants, if
    that bwrap still runs."""
    family = json.loads((state / "sandboxes" / sandbox_id / "record.json").read_text())["family"]
    if start_time(family["bwrap_pid"]) != family["bwrap_started"]:
        return []
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(entry.path, "stat").read_text()
                children.setdefault(int(stat[stat.rindex(")") + 2:].split()[1]), []).append(int(entry.name))
    tree, todo = [], [family["bwrap_pid"]]
    while todo:
        tree.append(pid := todo.pop())
        todo.extend(children.get(pid, []))
    return tree


def agent_pid(sandbox_id: str) -> int:
    """The sandbox's agent, found under the bwrap process the engine recorded for it (in the
    state dir of this test run). sandbox_pids cannot find it when the engine runs as a normal
    user: the agent makes itself undumpable, so its environment cannot be read."""
    agents = [pid for pid in sandbox_tree(state_dir(), sandbox_id)
              if b"agent.py" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    # The agent forks helpers that run agent.py too: the agent is the one whose parent is not.
    (agent,) = [pid for pid in agents if parent_pid(pid) not in agents]
    return agent


def parent_pid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[1])


def cpu_ticks(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{pid}/stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            total += int(fields[11]) + int(fields[12])  # utime + stime
    return total


async def wait_status(client: SandboxClient, sandbox_id: str, want: SandboxStatus,
                      timeout: float = 15.0) -> tuple[list[SandboxStatus], object]:
    """Poll GET until `want`; return every status seen on the way and the final view."""
    seen: list[SandboxStatus] = []
    deadline = time.monotonic() + timeout
    while True:
        view = await client.get_sandbox(sandbox_id)
        if not seen or seen[-1] != view.status:
            seen.append(view.status)
        if view.status == want:
            return seen, view
        assert time.monotonic() < deadline, f"never {want.value}: saw {[s.value for s in seen]}"
        await asyncio.sleep(0.005)


def freezer_available(name: str) -> str | None:
    """None if this host can use the freezer, else why not."""
    try:
        freezers.select(name)
    except freezers.FreezerError as exc:
        return str(exc)
    return None


def sandbox_status(engine: EngineEndpoint, sandbox_id: str) -> SandboxStatus | None:
    """The sandbox's status as the engine reports it now (None once forgotten), for sync tests."""
    async def query() -> SandboxStatus | None:
        async with SandboxClient(engine.url, engine.token) as client:
            try:
                return (await client.get_sandbox(sandbox_id)).status
            except NotFoundError:
                return None

    return asyncio.run(query())


def stop_process(process: subprocess.Popen, grace: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited after `grace` seconds."""
    process.terminate()
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
