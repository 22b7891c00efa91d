"""The shape's memory, CPU and process limits on a local sandbox: cgroups, else rlimits.

Chosen once when the engine starts (probed for real, like the freezer):

- cgroup v1 (this is what hybrid hosts give root): one cgroup per sandbox in each of the
  memory, cpu and pids hierarchies, at /sys/fs/cgroup/<controller>/sandbox-kernel/<id>,
  next to the v1 freezer's. The engine moves bwrap into them before bwrap reads its
  options, so every process of the sandbox, and of its forks, starts inside.
- cgroup v2: the limits go into the sandbox's freezer cgroup (its processes live in a leaf
  under it, see freezer.CgroupV2Freezer.attach), once the memory, cpu and pids controllers
  are enabled for its parent: under the host's root cgroup (root), or under the engine's
  own cgroup when that is delegated to its user (_hand_down_from_delegated).
- rlimits, when no cgroup can be made (a normal user without delegation): the agent sets
  them on itself as the sandbox starts, so they hold for everything it spawns. Memory is
  RLIMIT_DATA per process (RLIMIT_AS would break programs that reserve large address
  ranges); processes are RLIMIT_NPROC, counted per user in the sandbox's own user
  namespace on Linux >= 5.14 (older kernels count every process of the host user, so it
  is not set there, unless the engine runs as root: then each sandbox is a host user of
  its own). CPU has no rlimit that suits a long-lived kernel (RLIMIT_CPU kills).

Each limit is enforced by the first of these that works, or reported as not enforced.
`SANDBOX_KERNEL_LIMITS=rlimit` skips the cgroups (default `auto`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

from sandbox_kernel.local.freezer import GROUP, _cgroup2_mount, _move, _read, _remove, _write
from sandbox_kernel.local.hostuser import needs_own_user

log = logging.getLogger("sandbox_kernel.limits")

PIDS_MAX = 512  # processes and threads of one sandbox (a fork has its own)
CPU_PERIOD_US = 100_000
RLIMITS_ENV = "SANDBOX_RLIMITS"  # how the engine hands rlimit values to the agent
MEMORY, CPU, PIDS = "memory", "cpu", "pids"
CHOICES = ("auto", "rlimit")


class LimitsError(RuntimeError):
    pass


@dataclass(frozen=True)
class Limits:
    """What a shape allows one sandbox."""

    mem_mib: int
    vcpu: int
    disk_mib: int
    pids: int = PIDS_MAX

    @property
    def shm_mib(self) -> int:
        """The size of the sandbox's /dev/shm: half its memory, as a Linux VM of that size
        gets by default. Its pages are memory no rlimit counts (RLIMIT_DATA is per
        process and counts no shared memory), so without a memory cgroup this cap is the
        only bound on them; with one, they are charged to the sandbox as well."""
        return max(1, self.mem_mib // 2)


def _v1_mount(controller: str) -> Path | None:
    """Where the cgroup v1 hierarchy carrying `controller` is mounted (co-mounts included)."""
    with contextlib.suppress(OSError):
        for line in _read(Path("/proc/self/mountinfo")).splitlines():
            left, _, right = line.partition(" - ")
            fstype, _, options = right.split(" ", 2) if right.count(" ") >= 2 else (right, "", "")
            if fstype == "cgroup" and controller in options.split(","):
                return Path(left.split()[4])
    return None


def _write_if_present(path: Path, value: str) -> None:
    if path.exists():
        _write(path, value)


def _apply_v1(controller: str, cgroup: Path, limits: Limits) -> None:
    if controller == MEMORY:
        memory = str(limits.mem_mib * 1024 * 1024)
        _write(cgroup / "memory.limit_in_bytes", memory)
        # memory+swap too (must come second: it may not be below the memory limit), so a
        # host with swap does not give the sandbox more than its shape.
        _write_if_present(cgroup / "memory.memsw.limit_in_bytes", memory)
    elif controller == CPU:
        _write(cgroup / "cpu.cfs_period_us", str(CPU_PERIOD_US))
        _write(cgroup / "cpu.cfs_quota_us", str(limits.vcpu * CPU_PERIOD_US))
    elif controller == PIDS:
        _write(cgroup / "pids.max", str(limits.pids))


def _apply_v2(controller: str, cgroup: Path, limits: Limits) -> None:
    if controller == MEMORY:
        _write(cgroup / "memory.max", str(limits.mem_mib * 1024 * 1024))
        _write_if_present(cgroup / "memory.swap.max", "0")
    elif controller == CPU:
        _write(cgroup / "cpu.max", f"{limits.vcpu * CPU_PERIOD_US} {CPU_PERIOD_US}")
    elif controller == PIDS:
        _write(cgroup / "pids.max", str(limits.pids))


def _oom_kills(events: Path) -> int:
    """The `oom_kill N` count of memory.events (v2) or memory.oom_control (v1)."""
    with contextlib.suppress(OSError, ValueError):
        for line in _read(events).splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    return 0


def _hand_down_from_delegated(own: Path, wanted: set[str]) -> None:
    """When the engine's parent cgroup for sandboxes lies in the engine's own cgroup and that
    is delegated to the engine's (non-root) user (e.g. an app started with `systemd-run
    --user --scope -p Delegate=yes`), hand the controllers down from it. cgroup v2 allows
    that only while it holds no process itself, so its processes (the engine, and the app
    that started it) move to a leaf of their own first, as systemd expects of a delegatee."""
    if os.geteuid() == 0 or own == _cgroup2_mount() or own.stat().st_uid != os.geteuid():
        return  # never touch the host's cgroups, nor ones not given to us
    missing = (set(_read(own / "cgroup.controllers").split()) & wanted) - set(
        _read(own / "cgroup.subtree_control").split())
    if not missing:
        return
    if _read(own / "cgroup.procs").split():
        leaf = own / "engine"
        leaf.mkdir(exist_ok=True)
        for pid in _read(own / "cgroup.procs").split():
            with contextlib.suppress(OSError):  # it may have exited meanwhile
                _write(leaf / "cgroup.procs", pid)
    for controller in sorted(missing):
        with contextlib.suppress(OSError):
            _write(own / "cgroup.subtree_control", "+" + controller)


def _enable_v2_controllers(parent: Path) -> set[str]:
    """Enable memory, cpu and pids for the children of `parent`; the ones that took."""
    wanted = {MEMORY, CPU, PIDS}
    with contextlib.suppress(OSError):
        _hand_down_from_delegated(parent.parent, wanted)
    available = set(_read(parent / "cgroup.controllers").split()) & wanted
    enabled = set(_read(parent / "cgroup.subtree_control").split())
    for controller in sorted(available - enabled):
        with contextlib.suppress(OSError):  # e.g. EBUSY: parent has processes of its own
            _write(parent / "cgroup.subtree_control", "+" + controller)
    return set(_read(parent / "cgroup.subtree_control").split()) & wanted


def nproc_rlimit_is_per_sandbox() -> bool:
    """RLIMIT_NPROC counts per user namespace from Linux 5.14 (ucounts), per host uid before.
    An engine run as root gives each sandbox a host uid of its own (hostuser.py): then it
    is per sandbox on any kernel (a fork shares its source's)."""
    if needs_own_user():
        return True
    with contextlib.suppress(ValueError):
        major, minor = (int(part) for part in platform.release().split(".")[:2])
        return (major, minor) >= (5, 14)
    return False


@dataclass
class Applied:
    """The limits held on one sandbox and where they live."""

    sandbox_id: str
    description: str = ""  # Limiter.describe for this sandbox
    v1_cgroups: dict[str, Path] = field(default_factory=dict)  # controller -> its cgroup
    v2_cgroup: Path | None = None
    oom_events: Path | None = None  # the file counting the sandbox's OOM kills

    def oom_kills(self) -> int:
        return _oom_kills(self.oom_events) if self.oom_events else 0

    def move(self, pids: set[int]) -> None:
        """Take these processes out of the sandbox's v1 cgroups (see Freezer.detach)."""
        for cgroup in self.v1_cgroups.values():
            with contextlib.suppress(OSError):
                _move(cgroup.parent, pids)

    def release(self) -> None:
        """Remove the v1 cgroups once the sandbox's processes are gone (v2: the freezer's)."""
        for cgroup in self.v1_cgroups.values():
            _remove(cgroup)


class Limiter:
    """Chosen at engine start: which mechanism holds each limit on this host."""

    def __init__(self, v2_parent: Path | None = None, cgroups: bool = True) -> None:
        """`v2_parent`: the cgroup v2 freezer's parent cgroup, if the freezer is v2;
        `cgroups`: False to use rlimits only."""
        self.v1: dict[str, Path] = {}  # controller -> parent cgroup for sandboxes
        self.v2: set[str] = set()
        if not cgroups:
            self.nproc_rlimit = nproc_rlimit_is_per_sandbox()
            return
        if v2_parent is not None:
            with contextlib.suppress(OSError):
                v2_parent.mkdir(exist_ok=True)
                self.v2 = _enable_v2_controllers(v2_parent)
        for controller in (MEMORY, CPU, PIDS):
            if controller not in self.v2:
                parent = self._probe_v1(controller)
                if parent is not None:
                    self.v1[controller] = parent
        self.nproc_rlimit = PIDS not in self.held_by_cgroups() and nproc_rlimit_is_per_sandbox()

    @staticmethod
    def _probe_v1(controller: str) -> Path | None:
        mount = _v1_mount(controller)
        if mount is None:
            return None
        parent = mount / GROUP
        probe = parent / f"probe-{os.getpid()}"
        try:
            parent.mkdir(exist_ok=True)
            probe.mkdir(exist_ok=True)
            probe.rmdir()
        except OSError as exc:
            log.info("cgroup v1 %s not usable: %s", controller, exc)
            return None
        return parent

    def held_by_cgroups(self) -> set[str]:
        return set(self.v1) | self.v2

    def mechanism(self, controller: str, cgroups: dict[str, str] | None = None) -> str | None:
        """How `controller`'s limit is held: by the cgroups given (controller -> 'cgroup vN',
        default: what this host allows), else by an rlimit, else None."""
        if cgroups is None:
            cgroups = {**{c: "cgroup v1" for c in self.v1}, **{c: "cgroup v2" for c in self.v2}}
        if controller in cgroups:
            return cgroups[controller]
        if controller == MEMORY and MEMORY not in self.held_by_cgroups():
            return "rlimit, per process"
        if controller == PIDS and self.nproc_rlimit:
            return "rlimit"
        return None

    def describe(self, limits: Limits, disk: str | None, cgroups: dict[str, str] | None = None) -> str:
        """One line, e.g. 'memory 512 MiB (cgroup v1), cpu 1 vCPU (cgroup v1), ...'."""
        parts = []
        for controller, amount in ((MEMORY, f"{limits.mem_mib} MiB"), (CPU, f"{limits.vcpu} vCPU"),
                                   (PIDS, str(limits.pids))):
            how = self.mechanism(controller, cgroups)
            parts.append(f"{controller} {amount} ({how})" if how else f"{controller}: not enforced")
        parts.append(f"disk {limits.disk_mib} MiB ({disk})" if disk else "disk: not enforced")
        return ", ".join(parts)

    def rlimits(self, limits: Limits) -> str:
        """The rlimits the agent must set on itself ('' when cgroups hold everything):
        'data=BYTES,nproc=N', passed through RLIMITS_ENV."""
        values = []
        if MEMORY not in self.held_by_cgroups():
            values.append(f"data={limits.mem_mib * 1024 * 1024}")
        if self.nproc_rlimit:
            values.append(f"nproc={limits.pids}")
        return ",".join(values)

    def attach(self, sandbox_id: str, limits: Limits, pids: tuple[int, ...],
               v2_cgroup: Path | None, disk: str | None) -> Applied:
        """Put these (not yet started) processes under the limits. `v2_cgroup`: the
        sandbox's v2 freezer cgroup, which the v2 limits must share; `disk`: how its disk
        size is capped, if it is. A limit that cannot be applied is logged and left off
        (and out of the description); the sandbox still starts."""
        applied = Applied(sandbox_id)
        held: dict[str, str] = {}
        for controller in sorted(self.v2):
            if v2_cgroup is None:
                break
            try:
                _apply_v2(controller, v2_cgroup, limits)
            except OSError as exc:
                log.warning("sandbox %s: cgroup v2 %s limit failed: %s", sandbox_id, controller, exc)
                continue
            applied.v2_cgroup = v2_cgroup
            held[controller] = "cgroup v2"
            if controller == MEMORY:
                applied.oom_events = v2_cgroup / "memory.events"
        for controller, parent in sorted(self.v1.items()):
            try:
                cgroup = self._new_v1(parent / sandbox_id, controller, limits, pids)
            except OSError as exc:
                log.warning("sandbox %s: cgroup v1 %s limit failed: %s", sandbox_id, controller, exc)
                continue
            applied.v1_cgroups[controller] = cgroup
            held[controller] = "cgroup v1"
            if controller == MEMORY:
                applied.oom_events = cgroup / "memory.oom_control"
        applied.description = self.describe(limits, disk, held)
        return applied

    @staticmethod
    def _new_v1(cgroup: Path, controller: str, limits: Limits, pids: tuple[int, ...]) -> Path:
        cgroup.mkdir()
        try:
            _apply_v1(controller, cgroup, limits)  # limits first, then the processes
            _move(cgroup, pids)
        except OSError:
            _remove(cgroup)
            raise
        return cgroup

    def reap(self, sandbox_ids: set[str]) -> None:
        """Kill what is left in the v1 cgroups of these sandboxes (an engine that died
        before destroying them) and remove the cgroups."""
        for parent in self.v1.values():
            for sandbox_id in sandbox_ids:
                cgroup = parent / sandbox_id
                if cgroup.is_dir():
                    _remove(cgroup)  # kills what is still inside while it waits


def select(v2_parent: Path | None = None, choice: str | None = None) -> Limiter:
    """The limiter SANDBOX_KERNEL_LIMITS asks for (auto: cgroups where they work)."""
    choice = (choice or os.environ.get("SANDBOX_KERNEL_LIMITS") or "auto").strip().lower()
    if choice not in CHOICES:
        raise LimitsError(f"SANDBOX_KERNEL_LIMITS={choice!r}: use one of {', '.join(CHOICES)}")
    return Limiter(v2_parent, cgroups=choice == "auto")
