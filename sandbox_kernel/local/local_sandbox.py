"""One local sandbox as the engine holds it (LocalSandbox: its state, its view, the record a
later engine takes it over from) and the bwrap container it lives in (Family), with the
tail of what that container writes to its console (ConsoleTail)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

from sandbox_kernel.api.models import SandboxStatus, SandboxView, Shape
from sandbox_kernel.local import registry
from sandbox_kernel.local.access_tokens import AccessToken
from sandbox_kernel.local.agent_client import AgentClient, AgentConnections
from sandbox_kernel.local.bwrap import SandboxDirs
from sandbox_kernel.local.catalog import HOST_PYTHON
from sandbox_kernel.local.direct_input import DirectInput
from sandbox_kernel.local.egress_gate import EgressGate
from sandbox_kernel.local.engine_errors import EngineError
from sandbox_kernel.local.freezer import Freezer, Handle
from sandbox_kernel.local.hostuser import HostUser
from sandbox_kernel.local.limits import Applied, Limits
from sandbox_kernel.local.signal_relay import SignalRelay

CONSOLE_TAIL = 4096  # bytes kept of what a sandbox writes to bwrap's stdout and stderr
CONSOLE_RATE = 1024 * 1024  # bytes per second read from there (writers past it wait)
LOCAL_REGION = "local"


def rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class Family:
    """One bwrap container and every sandbox forked from the one it was made for.

    Forks live in the container's pid namespace (a process cannot leave its pid
    namespace), so the container lives until its last member is destroyed: a destroyed
    member's agent stays on as the namespace's keeper while relatives remain.
    """

    process: asyncio.subprocess.Process | registry.AdoptedProcess
    founder: str  # the sandbox bwrap was started for; its agent holds the namespace
    # What its processes write to the stdout and stderr bwrap was given (None for a family
    # taken over from an earlier engine: that pipe's reader was the earlier engine).
    console: ConsoleTail | None
    members: set[str] = field(default_factory=set)  # ids of its sandboxes not yet destroyed
    # Host pids that hold the pid namespace: bwrap, its init and the command init runs
    # (the founder's agent). Noted once the agent answers, before any user process exists
    # (later, orphans of the sandbox also become init's children).
    keepers: set[int] = field(default_factory=set)

    def note_keepers(self) -> None:
        init = child_pids(self.process.pid)
        self.keepers = {self.process.pid, *init, *(p for i in init for p in child_pids(i))}

    def check_fork_members(self, agent_pid: int, followers: list[int]) -> None:
        """Refuse a fork whose processes, as the source's agent reported them, are not all
        in the fork's mount namespace or include a keeper: they go into the fork's cgroups,
        and the agent got the follower pids from registrations code in the sandbox writes."""
        fork_root = os.readlink(f"/proc/{agent_pid}/ns/mnt")
        for pid in (agent_pid, *followers):
            if pid in self.keepers or os.readlink(f"/proc/{pid}/ns/mnt") != fork_root:
                raise EngineError(f"fork: process {pid} is not the new sandbox's")

    def host_pid(self, ns_pid: int) -> int:
        """The host pid of the family process known inside as ns_pid."""
        init = child_pids(self.process.pid)
        namespace = os.readlink(f"/proc/{init[0]}/ns/pid")
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                if os.readlink(f"{entry.path}/ns/pid") != namespace:
                    continue
                for line in open(f"{entry.path}/status"):
                    if line.startswith("NSpid:") and line.split()[-1] == str(ns_pid):
                        return int(entry.name)
        raise LookupError(f"no process {ns_pid} in the sandbox's pid namespace")


class ConsoleTail:
    """Drains the pipe a sandbox got as bwrap's stdout and stderr, keeping only its end.

    bwrap, the disk's mount step and the agent report start failures there. It is never a
    host file (every process of the sandbox could fill the host's disk through it, past the
    sandbox's cap) nor held whole: the last CONSOLE_TAIL bytes are kept, and it is read at
    CONSOLE_RATE at most, so a flood costs the engine little and its writers wait. Only
    start failures are read from it: a sandbox taken over from an earlier engine has no
    reader any more, and a write there fails (EPIPE).
    """

    def __init__(self, pipe: asyncio.StreamReader) -> None:
        self.tail = b""
        self.task = asyncio.get_running_loop().create_task(self._drain(pipe))

    async def _drain(self, pipe: asyncio.StreamReader) -> None:
        while chunk := await pipe.read(64 * 1024):
            self.tail = (self.tail + chunk)[-CONSOLE_TAIL:]
            await asyncio.sleep(len(chunk) / CONSOLE_RATE)

    async def last_words(self) -> str:
        """The end of what was written, once its writers are gone (bwrap exited)."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.task), 1.0)
        return self.tail.decode(errors="replace").strip()


def child_pids(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as children:
            return [int(p) for p in children.read().split()]
    except OSError:
        return []


@dataclass
class LocalSandbox:
    id: str
    name: str
    shape: Shape
    dirs: SandboxDirs
    envs: dict[str, str]
    egress: list[str]
    auto_pause_after_seconds: int | None
    disk_mib: int  # the shape's default unless the create request asked for another size
    rootfs: str = HOST_PYTHON  # as asked for: a local name or a CreateOS catalog alias
    status: SandboxStatus = SandboxStatus.CREATING
    created_at: float = field(default_factory=time.time)
    running_at: float | None = None
    destroyed_at: float | None = None
    spawn_ms: int | None = None
    paused_at: float | None = None
    last_resumed_at: float | None = None
    family: Family | None = None
    forked_from: str | None = None
    gate: EgressGate | None = None  # its way out (started once it runs)
    signals: SignalRelay | None = None  # its requests to pause or delete itself (§9)
    # Pausing: which freezer holds this sandbox's processes, and the pause/resume in flight.
    freezer: Freezer | None = None
    frozen: Handle | None = None
    limited: Applied | None = None  # the shape's limits as held on this host
    host_user: HostUser | None = None  # the host uid it runs as, when the engine is root
    transition: asyncio.Task | None = None
    access_token: AccessToken | None = None  # §15.4: a key for this sandbox alone
    # Auto-pause: last exec/file request (monotonic) and execs still streaming.
    last_activity: float = field(default_factory=time.monotonic)
    active_execs: int = 0
    agent_connections: AgentConnections = field(default_factory=AgentConnections)
    direct_input: DirectInput = field(default_factory=DirectInput)  # stdins it writes itself
    # Held while one of the engine's threads works for this sandbox (Engine._blocking).
    blocking_work: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def limits(self) -> Limits:
        return Limits(mem_mib=self.shape.mem_mib, vcpu=self.shape.vcpu, disk_mib=self.disk_mib)

    @property
    def agent(self) -> AgentClient:
        # Always the socket the engine bound in the sandbox's own host dir (a fork's too):
        # never a path inside a sandbox, where its code decides what a path leads to.
        return AgentClient(self.dirs.agent, self.agent_connections)

    def view(self) -> SandboxView:
        return SandboxView(
            id=self.id, status=self.status, name=self.name, shape=self.shape.id,
            rootfs=self.rootfs, vcpu=self.shape.vcpu, mem_mib=self.shape.mem_mib,
            disk_mib=self.disk_mib, created_at=rfc3339(self.created_at),
            running_at=rfc3339(self.running_at) if self.running_at else None,
            destroyed_at=rfc3339(self.destroyed_at) if self.destroyed_at else None,
            ingress_enabled=False, region=LOCAL_REGION, spawn_ms=self.spawn_ms, egress=list(self.egress),
            envs=sorted(self.envs), auto_pause_after_seconds=self.auto_pause_after_seconds,
            forked_from=self.forked_from,
            paused_at=rfc3339(self.paused_at) if self.paused_at else None,
            last_resumed_at=rfc3339(self.last_resumed_at) if self.last_resumed_at else None,
            oom_kills=self.limited.oom_kills() if self.limited else None,
            limits=self.limited.description if self.limited else None)

    def record(self) -> dict:
        """What a later engine needs to take this sandbox over (registry.py)."""
        family, frozen, limited, token = self.family, self.frozen, self.limited, self.access_token
        assert family is not None
        return {
            "id": self.id, "name": self.name, "shape": self.shape.id, "envs": self.envs,
            "egress": self.egress, "auto_pause_after_seconds": self.auto_pause_after_seconds,
            "disk_mib": self.disk_mib, "rootfs": self.rootfs, "status": self.status.value,
            "created_at": self.created_at, "running_at": self.running_at, "spawn_ms": self.spawn_ms,
            "paused_at": self.paused_at, "last_resumed_at": self.last_resumed_at,
            "forked_from": self.forked_from,
            "host_user": self.host_user.uid if self.host_user else None,
            "access_token": token and {"hashed": token.hashed.hex(), "hint": token.hint,
                                       "created_at": token.created_at, "rotated_at": token.rotated_at,
                                       "enabled": token.enabled},
            "family": {"founder": family.founder, "bwrap_pid": family.process.pid,
                       "bwrap_started": registry.start_time(family.process.pid),
                       "keepers": sorted(family.keepers)},
            "frozen": frozen and {"pid": frozen.pid, "cgroup": str(frozen.cgroup) if frozen.cgroup else None,
                                  "more": list(frozen.more), "stopped": sorted(frozen.stopped),
                                  "spared": sorted(frozen.spared)},
            "limited": limited and {"description": limited.description,
                                    "v1_cgroups": {k: str(v) for k, v in limited.v1_cgroups.items()},
                                    "v2_cgroup": str(limited.v2_cgroup) if limited.v2_cgroup else None,
                                    "oom_events": str(limited.oom_events) if limited.oom_events else None},
        }

    def touch(self) -> None:
        self.last_activity = time.monotonic()

    def idle_for(self) -> float:
        """Seconds with no exec/file request; 0 while an exec is still running."""
        return 0.0 if self.active_execs else time.monotonic() - self.last_activity
