"""The shape's limits on the local engine, and its hardening, tried for real.

Each test runs commands in real sandboxes and looks at what the kernel of the host did:
the OOM killer's count, EAGAIN from fork, ENOSPC, the CPU controller's throttling, EPERM
from seccomp. Limits that this host cannot enforce are skipped with the reason (doctor
reports the same).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from engine_helpers import destroy_every_sandbox, running_engine, sandbox_pids, wait_status
from sandbox_kernel.api import CreateSandboxRequest, SandboxClient, SandboxStatus
from sandbox_kernel.local import disk
from sandbox_kernel.local.freezer import select as select_freezer
from sandbox_kernel.local.limits import PIDS_MAX, select as select_limiter
from sandbox_kernel.local.service import EngineEndpoint, ensure_engine

pytestmark = pytest.mark.slow

LIMITER = select_limiter()
NEEDS_CGROUP_V1 = pytest.mark.skipif(
    not {"memory", "cpu", "pids"} <= set(LIMITER.v1),
    reason="cgroup v1 memory/cpu/pids hierarchies are not writable here")
NEEDS_DISK_CAP = pytest.mark.skipif(not disk.available(), reason="capped volumes need root and loop devices")


async def run(client: SandboxClient, sandbox_id: str, script: str, timeout: float | None = None) -> tuple[int, str]:
    """Run a shell script in the sandbox: (exit code, stdout + stderr)."""
    result = (await client.exec(sandbox_id, "sh", ["-c", script], timeout=timeout)).result
    return result.exit_code, result.stdout + result.stderr


def loop_devices_backed_by(image: Path) -> list[str]:
    found = []
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        with contextlib.suppress(OSError):
            if backing.read_text().strip().removesuffix(" (deleted)") == str(image):
                found.append(backing.parent.parent.name)
    return found


def python(code: str) -> str:
    return "python3 -c " + repr(code).replace("\\n", "\n")  # sh keeps the newlines


@pytest.fixture
async def sandbox(client: SandboxClient) -> AsyncIterator[str]:
    created = await client.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-256mb", disk_mib=64))
    yield created.id
    await client.delete_sandbox(created.id)


@NEEDS_CGROUP_V1
async def test_the_sandbox_view_says_which_limits_hold(client: SandboxClient, sandbox: str) -> None:
    view = await client.get_sandbox(sandbox)
    assert view.limits is not None
    assert view.limits.startswith(
        f"memory 256 MiB (cgroup v1), cpu 1 vCPU (cgroup v1), pids {PIDS_MAX} (cgroup v1), disk 64 MiB")
    assert view.oom_kills == 0


@NEEDS_CGROUP_V1
async def test_a_memory_bomb_is_killed_and_counted_and_others_keep_working(
        client: SandboxClient, sandbox: str) -> None:
    other = (await client.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-256mb"))).id
    try:
        code, output = await run(client, sandbox, python("b = b'x' * (512 << 20)\nprint('survived')"))
        assert code == 137 and "survived" not in output  # SIGKILL from the OOM killer
        assert (await client.get_sandbox(sandbox)).oom_kills == 1
        assert await run(client, sandbox, "echo still here") == (0, "still here\n")
        assert await run(client, other, "echo unaffected") == (0, "unaffected\n")
        assert (await client.get_sandbox(other)).oom_kills == 0
    finally:
        await client.delete_sandbox(other)


@NEEDS_CGROUP_V1
async def test_a_fork_bomb_stops_at_the_pids_limit(client: SandboxClient, sandbox: str) -> None:
    bomb = python(
        "import os, signal, time\n"
        "children = []\n"
        "try:\n"
        "    while len(children) < 5000:\n"
        "        pid = os.fork()\n"
        "        if pid == 0:\n"
        "            time.sleep(30)\n"
        "            os._exit(0)\n"
        "        children.append(pid)\n"
        "except OSError as exc:\n"
        "    print(len(children), exc.errno)\n"
        "for pid in children:\n"
        "    os.kill(pid, signal.SIGKILL)\n")
    code, output = await run(client, sandbox, bomb)
    started, errno_ = output.split()
    assert code == 0 and errno_ == "11"  # EAGAIN
    assert 400 < int(started) < PIDS_MAX  # the agent, sh and python count too
    assert await run(client, sandbox, "echo after") == (0, "after\n")


@NEEDS_CGROUP_V1
async def test_at_the_memory_limit_the_oom_killer_spares_the_agent(client: SandboxClient, sandbox: str) -> None:
    [agent] = sandbox_pids(sandbox, b"agent.py")
    assert Path(f"/proc/{agent}/oom_score_adj").read_text().strip() == "0"
    assert await run(client, sandbox, "cat /proc/self/oom_score_adj") == (0, "500\n")  # goes first
    swarm = python(
        "import os, time\n"
        "for _ in range(200):\n"
        "    if os.fork() == 0:\n"
        "        hoard = b'x' * (4 << 20)\n"  # 200 x 4 MiB: far past 256 MiB
        "        time.sleep(3)\n"
        "        os._exit(0)\n"
        "for _ in range(200):\n"
        "    os.wait()\n")
    # As long as the swarm takes: at the limit the sandbox thrashes before each OOM kill (9 to
    # over 60 s in CI runs; the client's default read timeout is 60 s).
    await run(client, sandbox, swarm, timeout=600)
    assert (await client.get_sandbox(sandbox)).oom_kills > 0
    assert sandbox_pids(sandbox, b"agent.py") == [agent]
    assert await run(client, sandbox, "echo the sandbox lives") == (0, "the sandbox lives\n")


@NEEDS_DISK_CAP
async def test_filling_the_disk_gives_enospc_inside_and_costs_the_host_only_the_cap(
        client: SandboxClient, sandbox: str, state_dir: Path) -> None:
    code, output = await run(client, sandbox,
                             "dd if=/dev/zero of=/workspace/fill bs=1M count=200; "
                             "dd if=/dev/zero of=/tmp/more bs=1M count=10")
    assert code != 0 and output.count("No space left on device") == 2
    image = state_dir / "sandboxes" / sandbox / "disk.img"
    assert image.stat().st_blocks * 512 <= 70 << 20  # the 64 MiB volume, nothing more
    code, output = await run(client, sandbox, "rm /workspace/fill && echo x > /workspace/ok && cat /workspace/ok")
    assert (code, output) == (0, "x\n")


@NEEDS_CGROUP_V1
async def test_cpu_spin_in_many_processes_gets_one_vcpu(client: SandboxClient, sandbox: str) -> None:
    spin = python(
        "import os, time\n"
        "start = time.time()\n"
        "for _ in range(4):\n"
        "    if os.fork() == 0:\n"
        "        while time.time() - start < 3:\n"
        "            pass\n"
        "        os._exit(0)\n"
        "for _ in range(4):\n"
        "    os.wait()\n"
        "used = os.times()\n"
        "print((used.children_user + used.children_system) / (time.time() - start))\n")
    code, output = await run(client, sandbox, spin)
    assert code == 0
    # 4 busy processes, 1 vCPU: never the host's 2 cores. (A loaded host gives less anyway,
    # so also check that the quota is set and every process of the sandbox is under it.)
    assert float(output) < 1.25
    cgroup = LIMITER.v1["cpu"] / sandbox
    assert int((cgroup / "cpu.cfs_quota_us").read_text()) == int((cgroup / "cpu.cfs_period_us").read_text())
    assert set(sandbox_pids(sandbox)) <= {int(pid) for pid in (cgroup / "cgroup.procs").read_text().split()}


async def test_seccomp_blocks_dangerous_calls_with_eperm(client: SandboxClient, sandbox: str) -> None:
    from sandbox_kernel.local.seccomp import ARCHITECTURES
    import platform

    numbers = ARCHITECTURES[platform.machine()][1]
    names = ("init_module", "finit_module", "kexec_load", "bpf", "ptrace", "keyctl",
             "userfaultfd", "perf_event_open", "open_by_handle_at", "pidfd_getfd")
    probe = python(
        "import ctypes, sys\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "for number in map(int, sys.argv[1:]):\n"
        "    ctypes.set_errno(0)\n"
        "    print(libc.syscall(number, 0, 0, 0, 0, 0), ctypes.get_errno())\n"
        "TIOCSTI = 0x5412\n"
        "print(libc.ioctl(0, TIOCSTI, b'x'), ctypes.get_errno())\n"
        "print(libc.personality(0x0040000), ctypes.get_errno())\n"  # ADDR_NO_RANDOMIZE
        "print(libc.personality(0xffffffff) >= 0)\n")
    code, output = await run(client, sandbox, f"{probe} {' '.join(str(numbers[n]) for n in names)}")
    lines = output.splitlines()
    assert code == 0, output
    assert lines[:-1] == ["-1 1"] * (len(names) + 2)  # EPERM = 1, for each and both ioctl/personality
    assert lines[-1] == "True"  # an allowed call still works
    code, output = await run(client, sandbox, "grep -E '^(NoNewPrivs|Seccomp):' /proc/self/status")
    assert output.split() == ["NoNewPrivs:", "1", "Seccomp:", "2"]


async def test_the_agent_socket_cannot_be_replaced_from_inside(client: SandboxClient, sandbox: str) -> None:
    code, output = await run(client, sandbox,
                             "touch /run/sandbox-agent/agent.sock; touch /run/sandbox-agent/x; "
                             "mv /run/sandbox-agent /run/elsewhere; echo entries: $(ls -A /run/sandbox-agent | wc -l)")
    # The agent serves a socket the engine bound outside: its directory inside stays empty.
    assert output.count("Read-only file system") == 2 and "entries: 0\n" in output
    assert await run(client, sandbox, "echo agent still answers") == (0, "agent still answers\n")


async def test_a_fork_has_its_own_limits_and_its_agent_socket_is_sealed_too(
        client: SandboxClient, sandbox: str) -> None:
    await client.pause_sandbox(sandbox)
    await wait_status(client, sandbox, SandboxStatus.PAUSED)
    child = (await client.fork_sandbox(sandbox)).id
    try:
        _, view = await wait_status(client, child, SandboxStatus.RUNNING, timeout=30)
        assert view.limits is not None and view.limits.endswith("disk 64 MiB (tmpfs)")
        # As in its source: the agent serves a socket the engine bound outside, and the
        # directory inside is empty and read-only.
        code, output = await run(client, child, "touch /run/sandbox-agent/agent.sock; "
                                 "touch /run/sandbox-agent/x; echo entries: $(ls -A /run/sandbox-agent | wc -l)")
        assert output.count("Read-only file system") == 2 and "entries: 0\n" in output
        if "memory" in LIMITER.v1:  # the child's processes count against the child's limit
            procs = (LIMITER.v1["memory"] / child / "cgroup.procs").read_text().split()
            assert set(sandbox_pids(child)) <= {int(pid) for pid in procs}
    finally:
        await client.delete_sandbox(child)


async def test_rlimits_hold_when_no_cgroup_is_used(tmp_path: Path) -> None:
    """SANDBOX_KERNEL_LIMITS=rlimit: what a host without cgroup access gets."""
    with running_engine(tmp_path, SANDBOX_KERNEL_LIMITS="rlimit") as endpoint:
        async with SandboxClient(endpoint.url, endpoint.token) as api:
            created = await api.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-256mb"))
            view = await api.get_sandbox(created.id)
            assert view.limits is not None
            assert view.limits.startswith("memory 256 MiB (rlimit, per process), cpu: not enforced")
            # The sandbox is never host root (RLIMIT_NPROC would not bind root's processes).
            assert "pids 512 (rlimit)" in view.limits
            code, output = await run(api, created.id, python(
                "import os, resource, time\n"
                "print(resource.getrlimit(resource.RLIMIT_NPROC))\n"
                "resource.setrlimit(resource.RLIMIT_NPROC, (20, 512))  # lower: binds sooner\n"
                "children = []\n"
                "try:\n"
                "    for _ in range(100):\n"
                "        pid = os.fork()\n"
                "        if pid == 0:\n"
                "            time.sleep(5)\n"
                "            os._exit(0)\n"
                "        children.append(pid)\n"
                "except BlockingIOError:\n"
                "    print('EAGAIN', len(children) < 20)\n"))
            assert (code, output) == (0, "(512, 512)\nEAGAIN True\n")
            code, output = await run(api, created.id, python(
                "try:\n    b = bytearray(300 << 20)\nexcept MemoryError:\n    print('MemoryError')\n"
                "import resource\nprint(resource.getrlimit(resource.RLIMIT_DATA))"))
            assert (code, output) == (0, f"MemoryError\n({256 << 20}, {256 << 20})\n")
            await api.delete_sandbox(created.id)


def test_a_killed_engine_leaves_its_sandbox_to_the_next_one_which_reaps_the_rest(tmp_path: Path) -> None:
    """The sandbox outlives a SIGKILLed engine (no --die-with-parent) with its limits; the
    next engine takes it over, and destroying it then leaves no process, cgroup, loop
    device or file. A directory no record vouches for (a sandbox the dead engine was still
    creating) is reaped."""
    async def start_busy_sandbox(endpoint: EngineEndpoint) -> str:
        async with SandboxClient(endpoint.url, endpoint.token) as api:
            created = await api.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-256mb"))
            await run(api, created.id, "nohup sleep 300 >/dev/null 2>&1 &")
            return created.id

    async def check_and_destroy(endpoint: EngineEndpoint, sandbox_id: str) -> None:
        async with SandboxClient(endpoint.url, endpoint.token) as api:
            view = await api.get_sandbox(sandbox_id)
            assert view.status == SandboxStatus.RUNNING and view.limits and "memory 256 MiB" in view.limits
            assert await run(api, sandbox_id, "pgrep -c sleep") == (0, "1\n")
            await api.delete_sandbox(sandbox_id)

    log = open(tmp_path / "engine.log", "ab")
    engine = subprocess.Popen([sys.executable, "-m", "sandbox_kernel", "serve", "--state-dir", str(tmp_path)],
                              stdout=log, stderr=log, start_new_session=True)
    try:
        from sandbox_kernel.local.service import read_endpoint

        deadline = time.monotonic() + 30
        while (endpoint := read_endpoint(tmp_path)) is None:
            assert time.monotonic() < deadline and engine.poll() is None, "engine did not start"
            time.sleep(0.05)
        sandbox_id = asyncio.run(start_busy_sandbox(endpoint))
        assert sandbox_pids(sandbox_id, b"sleep")
    finally:
        engine.send_signal(signal.SIGKILL)
        engine.wait()
    assert sandbox_pids(sandbox_id, b"sleep")  # still running, with nobody managing it
    unvouched = tmp_path / "sandboxes" / "sb-half-made"
    unvouched.mkdir()
    with running_engine(tmp_path) as endpoint:
        assert not unvouched.exists()
        asyncio.run(check_and_destroy(endpoint, sandbox_id))
        deadline = time.monotonic() + 10
        while sandbox_pids(sandbox_id) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sandbox_pids(sandbox_id) == []
        leftovers = tmp_path / "sandboxes" / sandbox_id
        assert not leftovers.exists()
        if disk.available():  # its volume was mounted only in its own namespace: gone with it
            while loop_devices_backed_by(leftovers / "disk.img") and time.monotonic() < deadline:
                time.sleep(0.1)
            assert loop_devices_backed_by(leftovers / "disk.img") == []
        cgroup_parents = [*LIMITER.v1.values(), getattr(select_freezer(), "parent", None)]
        for parent in filter(None, cgroup_parents):
            assert not (parent / sandbox_id).exists()


async def test_the_engine_keeps_its_state_to_its_user(tmp_path: Path) -> None:
    """Token, socket, logs, lock, sandbox dirs and disk images: no access for group or others."""
    endpoint = ensure_engine(tmp_path, idle_timeout=60)
    try:
        async with SandboxClient(endpoint.url, endpoint.token) as api:
            created = await api.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-256mb", disk_mib=64))
            volume = tmp_path / "sandboxes" / created.id / "volume"
            made = [p for p in tmp_path.rglob("*") if volume not in (p, *p.parents)]
            expected = {"token", "engine.sock", "engine.json", "engine.log", "engine.lock",
                        "agent.sock"} | ({"disk.img"} if disk.available() else set())
            assert expected <= {p.name for p in made}
            assert [p for p in made if p.lstat().st_mode & 0o077] == []
            code, output = await run(api, created.id, "umask; touch /workspace/f; stat -c %a /workspace/f")
            assert (code, output) == (0, "0022\n644\n")  # the sandbox's own files: as usual
    finally:
        destroy_every_sandbox(endpoint)  # a stopped engine would leave it running
        os.kill(endpoint.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15  # it removes engine.json as it exits
        while (tmp_path / "engine.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
