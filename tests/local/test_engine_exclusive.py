"""One engine per state dir, for its whole life (issue 31, item 1): a second `serve` exits
naming the pid that serves the dir, and kernels that cannot reach a live engine (stopped,
busy) wait for it instead of starting a second one, which would take the first one's
sandboxes from under it.

Real engines, real kernels; the engine is stopped with SIGSTOP, as a loaded host or a
debugger stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from jupyter_client.asynchronous.client import AsyncKernelClient
from jupyter_client.manager import AsyncKernelManager

from engine_helpers import running_engine, sandbox_tree
from kernel_helpers import is_status_line
from message_spec import validate
from sandbox_kernel.api import CreateSandboxRequest, SandboxClient, SandboxStatus
from sandbox_kernel.local import service
from sandbox_kernel.local.registry import start_time
from sandbox_kernel.local.service import EngineEndpoint, ensure_engine, read_endpoint, stop_engine

pytestmark = pytest.mark.slow

KERNELS = 20
STOPPED_FOR = 3.0  # seconds the engine stays stopped once every kernel is waiting for it
# What an engine logs when it takes over or removes what an earlier engine left (engine.py).
TAKE_OVER = re.compile(r"took over \d+ sandboxes|removing \d+ sandboxes")


def engines_serving(state: Path) -> list[int]:
    """Pids of every `sandbox-kernel serve` process on this state dir (stopped ones too)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                argv = Path(entry.path, "cmdline").read_bytes().split(b"\0")
                if b"serve" in argv and str(state).encode() in argv:
                    found.append(int(entry.name))
    return found


def connected_to(port: int, pids: list[int]) -> set[int]:
    """Those of `pids` with a TCP connection open to the loopback `port` (a kernel asking
    the engine whether it is up)."""
    inodes = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[2].rsplit(":", 1)[1], 16) == port:  # rem_address
                inodes.add(fields[9])
    found = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.scandir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(fd.path).removeprefix("socket:[").removesuffix("]") in inodes:
                        found.add(pid)
                        break
    return found


async def create_sandbox(endpoint: EngineEndpoint) -> str:
    async with SandboxClient(endpoint.url, endpoint.token) as api:
        return (await api.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-256mb"))).id


async def statuses(endpoint: EngineEndpoint) -> dict[str, SandboxStatus]:
    async with SandboxClient(endpoint.url, endpoint.token) as api:
        return {view.id: view.status for view in await api.list_sandboxes()}


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_second_serve_exits_naming_the_engine_and_takes_nothing(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    with running_engine(state) as first:
        sandbox_id = asyncio.run(create_sandbox(first))
        second = subprocess.run([sys.executable, "-m", "sandbox_kernel", "serve", "--state-dir", str(state)],
                                capture_output=True, text=True, timeout=60)
        assert second.returncode != 0
        assert second.stdout == ""
        assert second.stderr.splitlines() == [
            f"sandbox-kernel: the local engine of {state} is already running (pid {first.pid}); "
            "not starting a second one"]
        assert read_endpoint(state) == first and engines_serving(state) == [first.pid]
        assert asyncio.run(statuses(first)) == {sandbox_id: SandboxStatus.RUNNING}
        assert not TAKE_OVER.search((state / "engine.log").read_text())

        # The lock is the engine's alone: no process of the sandbox holds its file open. (As a
        # normal user, those inside the sandbox's user namespace cannot be looked into; they
        # are all bwrap's descendants, and could only have inherited the file from it.)
        from sandbox_kernel.local.engine_lock import LOCK_FILE

        lock_file = str(state / LOCK_FILE)
        looked_into = 0
        for pid in sandbox_tree(state, sandbox_id):
            with contextlib.suppress(PermissionError):
                assert all(os.readlink(fd.path) != lock_file for fd in os.scandir(f"/proc/{pid}/fd"))
                looked_into += 1
        assert looked_into >= 1  # bwrap's, at least


def test_a_sandbox_outliving_its_engine_keeps_no_lock(tmp_path: Path) -> None:
    """An engine killed outright leaves its sandboxes running and its state dir free: the
    next engine gets the lock, and takes the sandbox over."""
    from sandbox_kernel.local.engine_lock import EngineLock

    state = tmp_path / "state"
    state.mkdir()
    with running_engine(state) as first:
        sandbox_id = asyncio.run(create_sandbox(first))
        os.kill(first.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while start_time(first.pid) is not None:
            assert time.monotonic() < deadline, "the killed engine is still recorded as alive"
            time.sleep(0.02)
        assert sandbox_tree(state, sandbox_id)  # the sandbox lives on, without its engine
        with EngineLock.take(state):  # and no process of it holds the lock
            pass
        next_engine = ensure_engine(state, idle_timeout=120)
        try:
            assert asyncio.run(statuses(next_engine)) == {sandbox_id: SandboxStatus.RUNNING}
            assert "took over 1 sandboxes" in (state / "engine.log").read_text()
        finally:
            stop_engine(state)  # running_engine ends the sandbox with an engine of its own


def test_a_kernel_waits_for_a_stopped_engine_and_says_when_it_gives_up(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    state = tmp_path / "state"
    first = ensure_engine(state, idle_timeout=120)
    try:
        with stopped(first.pid):
            monkeypatch.setattr(service, "ENGINE_WAIT", 2 * STOPPED_FOR)
            with pytest.raises(RuntimeError) as gave_up:
                ensure_engine(state, idle_timeout=120)
            assert str(gave_up.value) == (f"the local engine (pid {first.pid}) has not answered for "
                                          f"{2 * STOPPED_FOR:.0f} s; not starting a second one on {state}: "
                                          f"see {state / 'engine.log'}")
            assert engines_serving(state) == [first.pid]
        assert ensure_engine(state, idle_timeout=120) == first
    finally:
        stop_engine(state)


@pytest.mark.one_path  # it pins the local engine (finding it is what is tested): both runs would be the same
@pytest.mark.timeout(900)
async def test_twenty_kernels_starting_while_the_engine_is_stopped_share_it(
        kernelspec: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = tmp_path / "state"
    state.mkdir()
    monkeypatch.setenv("SANDBOX_KERNEL_STATE_DIR", str(state))
    monkeypatch.delenv("CREATEOS_SANDBOX_API_KEY", raising=False)
    monkeypatch.delenv("CREATEOS_SANDBOX_BASE_URL", raising=False)
    first = await asyncio.to_thread(ensure_engine, state, 600)
    port = int(first.url.rsplit(":", 1)[1])
    earlier = await create_sandbox(first)  # what a second engine would take over
    managers = [AsyncKernelManager(kernel_name=kernelspec) for _ in range(KERNELS)]
    logs = [tmp_path / f"kernel-{index}.log" for index in range(KERNELS)]
    clients: list[AsyncKernelClient] = []
    try:
        with stopped(first.pid):
            for km, log in zip(managers, logs):
                with open(log, "wb") as output:
                    await km.start_kernel(stdout=output, stderr=output)
            pids = [km.provisioner.process.pid for km in managers]  # type: ignore[union-attr]
            # Stopped until every kernel has come to ask for it (the machine may be slow to
            # start twenty), or until a second engine shows up (the bug), then 3 s more.
            waiting: set[int] = set()
            deadline = time.monotonic() + 240
            while len(waiting) < KERNELS and engines_serving(state) == [first.pid]:
                assert time.monotonic() < deadline, f"only {len(waiting)} kernels came to the engine"
                waiting |= connected_to(port, pids)
                await asyncio.sleep(0.05)
            await asyncio.sleep(STOPPED_FOR)
        for km in managers:
            kc = km.client()
            kc.start_channels()
            clients.append(kc)
        await asyncio.gather(*(ready(kc, km, log) for kc, km, log in zip(clients, managers, logs)))
        replies = await asyncio.gather(*(first_cell(kc) for kc in clients))

        assert engines_serving(state) == [first.pid]
        assert read_endpoint(state) == first
        ran_in = {sandbox_id for sandbox_id, _ in replies}
        assert len(ran_in) == KERNELS  # one sandbox each, every first cell answered
        assert await statuses(first) == {sandbox_id: SandboxStatus.RUNNING for sandbox_id in {earlier, *ran_in}}
        assert not TAKE_OVER.search((state / "engine.log").read_text())
    finally:
        for kc in clients:
            kc.stop_channels()
        await asyncio.gather(*(km.shutdown_kernel(now=False) for km in managers if km.has_kernel),
                             return_exceptions=True)
        for pid in engines_serving(state):
            if pid != first.pid:  # a second engine (the bug): its process is not the first's
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
        with contextlib.suppress(Exception):
            async with SandboxClient(first.url, first.token) as api:
                await api.delete_sandbox(earlier)
        await asyncio.to_thread(stop_engine, state)


async def ready(kc: AsyncKernelClient, km: AsyncKernelManager, log: Path) -> None:
    """Wait for the kernel to answer kernel_info; if it cannot, fail with its exit status
    and what it wrote."""
    try:
        await kc.wait_for_ready(timeout=300)
    except RuntimeError as exc:
        process = km.provisioner.process  # type: ignore[union-attr]
        raise AssertionError(f"{exc} (pid {process.pid}, exit status {process.poll()}); "
                             f"it wrote:\n{log.read_text(errors='replace')[-4000:]}") from exc


async def first_cell(kc: AsyncKernelClient) -> tuple[str, dict]:
    """Run the kernel's first cell; the id of the sandbox it ran in, and its reply."""
    out: list[str] = []

    def collect(msg: dict) -> None:
        validate(msg)
        if msg["msg_type"] == "stream" and not is_status_line(msg):
            out.append(msg["content"]["text"])

    reply = await kc.execute_interactive("import os\nprint(os.environ['SANDBOX_ID'])", output_hook=collect,
                                         timeout=300)
    assert reply["content"]["status"] == "ok", reply["content"]
    return "".join(out).strip(), reply
