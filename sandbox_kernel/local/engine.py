"""The local engine's sandbox registry: create, look up, exec in, move files, destroy.

Each sandbox is one bwrap process whose main program is the agent (agent.py). The
engine never runs user commands itself: it asks the sandbox's agent, over the unix
socket the agent listens on inside the sandbox. The HTTP layer (server.py) turns these
methods into CreateOS routes; this module knows nothing about HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import resource
import secrets
import shutil
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sandbox_kernel.api.models import (
    CreateSandboxRequest,
    ForkSandboxRequest,
    PatchSandboxRequest,
    SandboxStatus,
    TERMINAL,
)
from sandbox_kernel.api.egress_rules import EgressRuleError, validate as validate_egress
from sandbox_kernel.local.agent_client import (
    AgentError,
    AgentUnavailable,
    RequestTooLarge,
    encoded,
    exec_request,
)
from sandbox_kernel.local.egress_gate import EgressGate
from sandbox_kernel.local.signal_relay import SignalRelay
from sandbox_kernel.guest import bundle as guest_bundle, protocol
from sandbox_kernel.local import disk, registry, seccomp
from sandbox_kernel.api.shapes import SHAPES
from sandbox_kernel.local.engine_errors import (
    AgentLost,
    Conflict,
    EngineError,
    EngineStopped,
    InvalidRequest,
    NotFound,
    SandboxStartFailed,
    ShuttingDown,
    TooLarge,
)
from sandbox_kernel.local.engine_lock import EngineLock
from sandbox_kernel.local.local_sandbox import LOCAL_REGION, ConsoleTail, Family, LocalSandbox, child_pids
from sandbox_kernel.local.access_tokens import AccessToken, digest
from sandbox_kernel.local.catalog import HOST_PYTHON, UnknownRootfs, local_rootfs
from sandbox_kernel.local.bwrap import (
    STAGE,
    Handover,
    SandboxDirs,
    bwrap_arguments,
    find_bwrap,
    launch_command,
)
from sandbox_kernel.local.hostuser import HostUser, allocate as allocate_host_user, needs_own_user
from sandbox_kernel.local.freezer import (
    CgroupV2Freezer,
    Freezer,
    Handle,
    SignalFreezer,
    select as select_freezer,
)
from sandbox_kernel.local.limits import Applied, select as select_limiter

log = logging.getLogger("sandbox_kernel.engine")

AGENT_FILES = guest_bundle.agent_files()  # the agent's programs (host side), bound into every sandbox
AGENT_START_TIMEOUT = 15.0
MAX_DISK_MIB = 1024 * 1024  # 1 TiB: a sparse image costs only what is written, but not without bound

# The same shape ids CreateOS offers, so a kernel configured for one works on the other.
ADJECTIVES = ("brave", "calm", "eager", "fond", "keen", "lucid", "merry", "quiet", "swift", "wise")
ANIMALS = ("otter", "heron", "lynx", "marten", "newt", "puffin", "stoat", "tapir", "vole", "wren")
KEEP_DESTROYED = 200
# Threads for the engine's own blocking work (freezer, disk image, file removal), apart
# from asyncio's default executor so no library's use of that can hold up pauses or
# destroys; each sandbox uses at most one of them at a time (Engine._blocking).
ENGINE_WORK_THREADS = 16
# Open files per process in a sandbox (soft, hard): the common defaults, whatever the engine
# has, and a sandbox cannot raise them. The engine raises its own soft limit to its hard
# one, since all sandboxes' egress connections and execs share its descriptors.
SANDBOX_NOFILE = (1024, 4096)
AUTO_PAUSE_CHECK_SECONDS = 2.0
# How long one second of auto_pause_after_seconds lasts on this engine: 1, except in the
# engine's own auto-pause test, which cannot wait out CreateOS's 60 s minimum in a suite
# with a time budget (it runs an engine of its own with a fraction of a second).
AUTO_PAUSE_SECOND_ENV = "SANDBOX_KERNEL_AUTO_PAUSE_SECOND"


def auto_pause_second() -> float:
    try:
        second = float(os.environ.get(AUTO_PAUSE_SECOND_ENV, "1"))
    except ValueError:
        return 1.0
    return second if 0 < second <= 1 else 1.0


# The statuses of a freeze or thaw under way (the engine's pause and resume); not the
# API's TRANSITIONAL, which has every status that changes on its own.
FREEZING_OR_THAWING = (SandboxStatus.PAUSING, SandboxStatus.RESUMING)
# How long a pause or resume request waits for its freeze or thaw before it answers. One
# done by then (nearly all: a thaw is one write, a freeze well under a millisecond) is
# answered `paused`/`running`, which spares the client a poll round trip, and its first
# sleep; a slower one is answered `pausing`/`resuming`, as CreateOS may answer either.
ANSWER_SETTLED_WITHIN = 0.05
# How long a fork request waits for its child to be made before it answers: a local fork
# takes ~0.1-0.3 s, and a child answered `running` is seen at once, where a client polling
# from `forking` sees it only at its next look (up to a third late, see session.py's
# POLL_GROWTH). A slower fork is answered `forking`, as CreateOS may answer.
ANSWER_FORKED_WITHIN = 1.0
HEARTBEAT_SECONDS = 5.0  # an idle stream (exec, process connect) gets a heartbeat this often


def checked_egress(rules: list[str] | None) -> list[str]:
    """The normalized rule list ([] = allow all public destinations); 400 naming a bad rule."""
    try:
        return validate_egress(rules)
    except EgressRuleError as exc:
        raise InvalidRequest(str(exc), code="invalid_egress_rule") from None


def raise_own_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:  # e.g. an unlimited hard limit above fs.nr_open
            log.warning("could not raise the open-files limit from %d: %s", soft, exc)
    log.info("open files limit: %d", resource.getrlimit(resource.RLIMIT_NOFILE)[0])


def limit_sandbox_fds() -> None:
    """In bwrap's process before exec (inherited by all of the sandbox): SANDBOX_NOFILE."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    cap = hard if hard != resource.RLIM_INFINITY else SANDBOX_NOFILE[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, tuple(min(limit, cap) for limit in SANDBOX_NOFILE))




def refuse_unsupported(request: CreateSandboxRequest | ForkSandboxRequest) -> None:
    """400 for a field the local engine cannot honour: never accept and quietly drop one."""
    why = {
        "ingress_enabled": "ingress is not supported by the local engine (no public URLs)",
        "ssh_pubkeys": "SSH access is not supported by the local engine",
        "networks": "overlay networks are not supported by the local engine",
        "disks": "persistent disks are not supported by the local engine",
        "host_id": "the local engine has one host and no host ids",
        "node_selector": "the local engine has one host and no placement labels",
        "bandwidth_quota_bytes": "bandwidth_quota_bytes cannot be set at create",
    }
    for field_name, reason in why.items():
        if getattr(request, field_name, None):  # None, False, 0, [] and {} ask for nothing
            raise InvalidRequest(reason, code=f"unsupported_{field_name}")
    region = getattr(request, "region", None)
    if region and region != LOCAL_REGION:
        raise InvalidRequest(f"region {region!r} is not this server's region ({LOCAL_REGION!r})",
                             code="region_mismatch")


def new_sandbox_id() -> str:
    # Time-ordered like CreateOS's ULID-based ids: 10 chars of milliseconds, 12 random.
    alphabet = "0123456789abcdefghjkmnpqrstvwxyz"
    millis = int(time.time() * 1000)
    stamp = "".join(alphabet[(millis >> (5 * i)) & 31] for i in reversed(range(10)))
    return "sb-" + stamp + "".join(secrets.choice(alphabet) for _ in range(12))


class Engine:
    def __init__(self, state_dir: Path, lock: EngineLock, bwrap: str | None = None) -> None:
        # Only the engine holding the state dir may take over or remove what an earlier
        # engine left there (engine_lock.py): a second one would take live sandboxes.
        if lock.state_dir != state_dir:
            raise ValueError(f"the lock held is {lock.state_dir}'s, not {state_dir}'s")
        self.sandbox_root = state_dir / "sandboxes"
        self.sandbox_root.mkdir(mode=0o700, parents=True, exist_ok=True)
        raise_own_fd_limit()
        self.bwrap = bwrap or find_bwrap()
        self.sandboxes: dict[str, LocalSandbox] = {}
        self.last_activity = time.monotonic()
        self.freezer = select_freezer()
        log.info("pausing sandboxes with: %s", self.freezer.describe())
        self.limiter = select_limiter(self.freezer.parent if isinstance(self.freezer, CgroupV2Freezer) else None)
        self.disk_capped = disk.available()
        self._auto_pauser: asyncio.Task | None = None
        self._reap_leftovers(self._adopt())
        # The engine's own API addresses: no egress rule may open their ports on any
        # address of the host to a sandbox.
        self.api_addresses: list[tuple[str, int]] = []
        self._fallback: Freezer | None = None  # for a sandbox the freezer could not attach
        self._background: set[asyncio.Task] = set()  # self-deletions under way
        self._work = ThreadPoolExecutor(ENGINE_WORK_THREADS, thread_name_prefix="engine-work")
        self.closing = False  # set on shutdown: no new sandboxes, running commands say why they end

    def touch(self) -> None:
        self.last_activity = time.monotonic()

    async def _blocking(self, sandbox: LocalSandbox, work: Callable[..., object], *args: object) -> object:
        """work(*args) in one of the engine's own threads, one call at a time per sandbox:
        however slow one sandbox's work is (a freeze waiting out its timeout, a huge file
        tree to remove), it holds one thread, and other sandboxes' pauses and destroys go on."""
        async with sandbox.blocking_work:
            return await asyncio.get_running_loop().run_in_executor(self._work, functools.partial(work, *args))

    @property
    def live_count(self) -> int:
        return sum(1 for sb in self.sandboxes.values() if sb.status not in TERMINAL)

    # -- lookup -----------------------------------------------------------------------

    def get(self, sandbox_id: str) -> LocalSandbox:
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is None:
            raise NotFound("sandbox not found", code="sandbox_not_found")
        return sandbox

    def running(self, sandbox_id: str) -> LocalSandbox:
        sandbox = self.get(sandbox_id)
        if sandbox.status != SandboxStatus.RUNNING:
            raise Conflict(f"sandbox is {sandbox.status.value}, not running", code="invalid_state")
        return sandbox

    def sandbox_for_token(self, offered: str) -> str | None:
        """The id of the sandbox whose enabled access token `offered` is, if any."""
        hashed = digest(offered)
        return next((sb.id for sb in self.sandboxes.values()
                     if sb.access_token and sb.access_token.accepts(hashed)), None)

    # -- access tokens (§15.4) -----------------------------------------------------------

    def create_access_token(self, sandbox_id: str) -> tuple[AccessToken, str]:
        sandbox = self.get(sandbox_id)
        if sandbox.access_token and sandbox.access_token.enabled:
            raise Conflict("the sandbox already has an enabled access token: rotate or disable it",
                           code="access_token_exists")
        sandbox.access_token, plaintext = AccessToken.issue()
        self._save(sandbox)
        return sandbox.access_token, plaintext

    def rotate_access_token(self, sandbox_id: str) -> tuple[AccessToken, str]:
        sandbox = self.get(sandbox_id)
        if not (sandbox.access_token and sandbox.access_token.enabled):
            raise NotFound("the sandbox has no access token to rotate", code="access_token_not_found")
        sandbox.access_token, plaintext = AccessToken.issue(previous=sandbox.access_token)
        self._save(sandbox)
        return sandbox.access_token, plaintext

    def disable_access_token(self, sandbox_id: str) -> AccessToken | None:
        sandbox = self.get(sandbox_id)
        if sandbox.access_token:
            sandbox.access_token.enabled = False
            self._save(sandbox)
        return sandbox.access_token

    def list(self, status: str | None = None) -> list[LocalSandbox]:
        found = sorted(self.sandboxes.values(), key=lambda sb: sb.created_at)
        if status:
            return [sb for sb in found if sb.status.value == status]
        return [sb for sb in found if sb.status != SandboxStatus.DESTROYED]

    # -- lifecycle --------------------------------------------------------------------

    async def create(self, request: CreateSandboxRequest) -> LocalSandbox:
        if self.closing:
            raise ShuttingDown("the local engine is shutting down", code="engine_shutting_down")
        shape = next((s for s in SHAPES if s.id == request.shape), None)
        if shape is None:
            raise InvalidRequest(f"unknown shape {request.shape!r}", code="unknown_shape")
        refuse_unsupported(request)
        try:
            local_rootfs(request.rootfs or HOST_PYTHON)
        except UnknownRootfs as exc:
            raise InvalidRequest(str(exc), code=exc.code) from None
        if request.disk_mib and request.disk_mib > MAX_DISK_MIB:
            raise InvalidRequest(f"disk_mib must be at most {MAX_DISK_MIB} (1 TiB)", code="invalid_disk_mib")
        name = request.name or self._free_name()
        if any(sb.name == name and sb.status not in TERMINAL for sb in self.sandboxes.values()):
            raise Conflict(f"a sandbox named {name!r} already exists", code="name_taken")
        sandbox_id = new_sandbox_id()
        sandbox = LocalSandbox(
            id=sandbox_id, name=name, shape=shape, dirs=SandboxDirs(self.sandbox_root / sandbox_id),
            envs=dict(request.envs or {}), egress=checked_egress(request.egress),
            auto_pause_after_seconds=request.auto_pause_after_seconds,
            disk_mib=request.disk_mib or shape.default_disk_mib, rootfs=request.rootfs or HOST_PYTHON)
        self.sandboxes[sandbox_id] = sandbox
        self._start_auto_pauser()
        try:
            await self._start(sandbox)
        except BaseException:  # a cancelled create (client gone) is cleaned up too
            sandbox.status = SandboxStatus.FAILED
            await asyncio.shield(self._stop(sandbox))
            raise
        return sandbox

    @property
    def disk_cap(self) -> str | None:
        """How a sandbox's disk size is capped here, if it is."""
        return "ext4 volume" if self.disk_capped else None

    async def _start(self, sandbox: LocalSandbox) -> None:
        started = time.monotonic()
        sandbox.dirs.root.mkdir(mode=0o700, parents=True)
        sandbox.dirs.create()
        if needs_own_user():
            sandbox.host_user = allocate_host_user(
                {sb.host_user.uid for sb in self.sandboxes.values() if sb.host_user})
            sandbox.host_user.give(sandbox.dirs.workspace, sandbox.dirs.tmp)
        image = sandbox.dirs.root / "disk.img"
        if self.disk_capped:
            await self._blocking(sandbox, disk.create, image, sandbox.dirs.volume, sandbox.disk_mib)
        listener = self._agent_listener(sandbox.dirs)
        seccomp_fd = seccomp.program_fd()
        handover = Handover(stage=sandbox.host_user is not None)
        args_read, args_write = os.pipe()
        try:
            arguments = "\0".join(bwrap_arguments(
                sandbox.id, sandbox.dirs, AGENT_FILES, seccomp_fd, handover, sandbox.limits.shm_mib,
                self.limiter.rlimits(sandbox.limits), packages=local_rootfs(sandbox.rootfs) == HOST_PYTHON)) + "\0"
            command = launch_command(handover.reachable(self.bwrap), args_read, listener.fileno())
            if sandbox.host_user:
                command = sandbox.host_user.launcher(STAGE, handover.staged, command)
            if self.disk_capped:  # mounted as root, before the drop to the sandbox's user
                command = disk.mounted(command, image, sandbox.dirs.volume)
            process = await asyncio.create_subprocess_exec(
                *command, start_new_session=True,  # no signal to the engine's group reaches it
                pass_fds=(args_read, seccomp_fd, listener.fileno(), *handover.fds),
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT, preexec_fn=limit_sandbox_fds)
        except BaseException:
            os.close(args_write)
            raise
        finally:
            os.close(args_read)
            os.close(seccomp_fd)
            handover.close()
            listener.close()  # the agent has its own copy
        assert process.stdout is not None
        sandbox.family = Family(process, founder=sandbox.id, members={sandbox.id},
                                console=ConsoleTail(process.stdout))
        # bwrap is blocked reading its options: put it into the sandbox's cgroup now, so
        # every process the sandbox ever creates starts inside it.
        self._attach(sandbox, process.pid)
        with os.fdopen(args_write, "wb") as pipe:  # a few KiB: fits the pipe buffer
            pipe.write(arguments.encode())
        await self._wait_for_agent(sandbox)
        sandbox.family.note_keepers()
        self._open_gate(sandbox)
        sandbox.spawn_ms = int((time.monotonic() - started) * 1000)
        sandbox.running_at = time.time()
        sandbox.status = SandboxStatus.RUNNING
        self._save(sandbox)
        asyncio.get_running_loop().create_task(self._watch(sandbox.family))
        log.info("sandbox %s running (%d ms)", sandbox.id, sandbox.spawn_ms)

    @staticmethod
    def _agent_listener(dirs: SandboxDirs) -> socket.socket:
        """The agent's listening socket, made here and handed to the agent (a founder's
        inherits it from bwrap, a fork's comes with the fork request): its directory is on
        the host, out of every sandbox's reach, so no sandboxed code can swap in a socket
        or a symlink of its own, and the engine follows no path a sandbox can write."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        dir_fd = os.open(dirs.agent, os.O_PATH)  # as AgentClient: past the sun_path limit
        try:
            listener.bind(f"/proc/self/fd/{dir_fd}/{dirs.agent_socket.name}")
            os.chmod(dirs.agent_socket, 0o600)  # (the directory is 0700 already)
            listener.listen(128)
        except OSError:
            listener.close()
            raise
        finally:
            os.close(dir_fd)
        return listener

    def _attach(self, sandbox: LocalSandbox, pid: int, *more: int) -> None:
        """Put the sandbox's first processes under its freezer and its limits."""
        try:
            sandbox.frozen = self.freezer.attach(sandbox.id, pid, *more)
            sandbox.freezer = self.freezer
        except Exception as exc:  # noqa: BLE001 - e.g. cgroup limit hit: still pausable by signals
            log.warning("sandbox %s: %s failed (%s); it will pause by SIGSTOP",
                        sandbox.id, self.freezer.describe(), exc)
            if not isinstance(self._fallback, SignalFreezer):
                self._fallback = SignalFreezer()
            sandbox.freezer = self._fallback
            sandbox.frozen = sandbox.freezer.attach(sandbox.id, pid, *more)
        v2_cgroup = sandbox.frozen.cgroup if isinstance(sandbox.freezer, CgroupV2Freezer) else None
        # A fork's files are a copy in memory (guest/nsfork.py): capped at the disk size
        # like a tmpfs, but counted as memory.
        disk_cap = self.disk_cap if sandbox.forked_from is None else "tmpfs"
        sandbox.limited = self.limiter.attach(sandbox.id, sandbox.limits, (pid, *more),
                                              v2_cgroup, disk_cap)

    async def _wait_for_agent(self, sandbox: LocalSandbox) -> None:
        deadline = time.monotonic() + AGENT_START_TIMEOUT
        assert sandbox.family is not None
        while time.monotonic() < deadline:
            if sandbox.family.process.returncode is not None:
                detail = await sandbox.family.console.last_words() if sandbox.family.console else ""
                raise SandboxStartFailed(f"sandbox failed to start: {detail[-500:] or 'bwrap exited'}")
            with contextlib.suppress(AgentUnavailable):
                await sandbox.agent.ping()
                return
            await asyncio.sleep(0.01)
        raise SandboxStartFailed(f"sandbox agent did not answer within {AGENT_START_TIMEOUT:.0f} s")

    async def _watch(self, family: Family) -> None:
        """Mark the sandboxes of a container that died on its own as `error` (they can
        still be destroyed)."""
        await family.process.wait()
        for sandbox_id in list(family.members):
            sandbox = self.sandboxes.get(sandbox_id)
            if sandbox and sandbox.status in (SandboxStatus.RUNNING, SandboxStatus.PAUSED, *FREEZING_OR_THAWING):
                log.warning("sandbox %s exited unexpectedly", sandbox.id)
                sandbox.status = SandboxStatus.ERROR

    async def destroy(self, sandbox_id: str) -> LocalSandbox:
        sandbox = self.get(sandbox_id)
        if sandbox.status in TERMINAL:
            return sandbox
        if sandbox.transition and not sandbox.transition.done():
            with contextlib.suppress(Exception):  # a pause/resume is short: let it finish
                await asyncio.shield(sandbox.transition)
            if sandbox.status in TERMINAL:
                return sandbox
        if sandbox.status == SandboxStatus.DESTROYING:
            raise Conflict("sandbox is already being destroyed", code="invalid_state")
        sandbox.status = SandboxStatus.DESTROYING
        await self._stop(sandbox)
        sandbox.status = SandboxStatus.DESTROYED
        sandbox.destroyed_at = time.time()
        self._forget_old_destroyed()
        return sandbox

    async def _stop(self, sandbox: LocalSandbox) -> None:
        # The freezer kills whatever it holds and thaws it (a frozen process only dies
        # once thawed). Killing bwrap's init, and with it the whole pid namespace, and
        # bwrap happens with the family's last sandbox. Before that,
        # the founder's agent, bwrap and its init stay, as the keepers of the namespace
        # its forks live in.
        if sandbox.gate:
            await sandbox.gate.stop()
        if sandbox.signals:
            await sandbox.signals.stop()
        # A founder's agent outlives it while its forks run (see below): its kept connections
        # would stay open with it. (Those in use end with their calls, as the agent is killed.)
        sandbox.agent_connections.close_idle()
        sandbox.direct_input.close()
        family = sandbox.family
        if family:
            family.members.discard(sandbox.id)
        last = family is None or not family.members
        if sandbox.freezer and sandbox.frozen:
            if family and not last and sandbox.id == family.founder:
                sandbox.freezer.detach(sandbox.frozen, family.keepers)
                if sandbox.limited:
                    sandbox.limited.move(family.keepers)
            await self._blocking(sandbox, sandbox.freezer.kill, sandbox.frozen)
        if last and family and family.process.returncode is None:
            # bwrap has no --die-with-parent (sandboxes outlive the engine), so its init
            # (read as bwrap's child while bwrap still runs) does not die with it.
            for pid in child_pids(family.process.pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            family.process.kill()
            await family.process.wait()
        if sandbox.freezer and sandbox.frozen:
            await self._blocking(sandbox, sandbox.freezer.release, sandbox.frozen)
            sandbox.frozen = None
        if sandbox.limited:
            await self._blocking(sandbox, sandbox.limited.release)
            sandbox.limited = None
        await self._blocking(sandbox, shutil.rmtree, sandbox.dirs.root, True)

    def _save(self, sandbox: LocalSandbox) -> None:
        if sandbox.family is not None and sandbox.status in (SandboxStatus.RUNNING, SandboxStatus.PAUSED):
            registry.save(sandbox.dirs.root, sandbox.record())

    def _adopt(self) -> set[str]:
        """Take over the sandboxes an earlier engine on this state dir left running or
        paused (registry.py); their ids."""
        families: dict[str, Family] = {}
        for record in registry.load(self.sandbox_root):
            shape = next((s for s in SHAPES if s.id == record["shape"]), None)
            if shape is None:
                continue
            kin = record["family"]
            family = families.get(kin["founder"])
            if family is None:
                family = families[kin["founder"]] = Family(
                    registry.AdoptedProcess(kin["bwrap_pid"], kin["bwrap_started"]),
                    founder=kin["founder"], console=None, keepers=set(kin["keepers"]))
            family.members.add(record["id"])
            status = SandboxStatus(record["status"])
            if record.get("agent_dir"):  # a fork made by an engine that reached its agent
                # inside the fork, where the sandbox's code decides where that path leads
                log.warning("sandbox %s: its agent cannot be reached safely (made by an older "
                            "engine): marked error", record["id"])
                status = SandboxStatus.ERROR
            sandbox = LocalSandbox(
                id=record["id"], name=record["name"], shape=shape,
                dirs=SandboxDirs(self.sandbox_root / record["id"]), envs=record["envs"],
                egress=record["egress"], auto_pause_after_seconds=record["auto_pause_after_seconds"],
                disk_mib=record["disk_mib"], rootfs=record["rootfs"],
                # a transition the old engine did not finish: say so rather than guess
                status=status if status in (SandboxStatus.RUNNING, SandboxStatus.PAUSED) else SandboxStatus.ERROR,
                created_at=record["created_at"], running_at=record["running_at"],
                spawn_ms=record["spawn_ms"], paused_at=record["paused_at"],
                last_resumed_at=record["last_resumed_at"], family=family,
                forked_from=record["forked_from"],
                host_user=HostUser(record["host_user"]) if record.get("host_user") is not None else None)
            if token := record.get("access_token"):
                sandbox.access_token = AccessToken(**{**token, "hashed": bytes.fromhex(token["hashed"])})
            if frozen := record["frozen"]:
                sandbox.freezer = self.freezer
                sandbox.frozen = Handle(sandbox.id, frozen["pid"], frozen["cgroup"] and Path(frozen["cgroup"]),
                                        tuple(frozen["more"]), set(frozen["stopped"]), set(frozen["spared"]))
            if limited := record["limited"]:
                sandbox.limited = Applied(
                    sandbox.id, limited["description"],
                    {name: Path(path) for name, path in limited["v1_cgroups"].items()},
                    limited["v2_cgroup"] and Path(limited["v2_cgroup"]),
                    limited["oom_events"] and Path(limited["oom_events"]))
            self.sandboxes[sandbox.id] = sandbox
        if self.sandboxes:
            log.info("took over %d sandboxes a previous engine left", len(self.sandboxes))
        return set(self.sandboxes)

    async def start_adopted(self, api_addresses: list[tuple[str, int]]) -> None:
        """Once the event loop runs and the API listens at `api_addresses`: egress gates,
        watchers and auto-pause for the sandboxes taken over (their idle time counts from
        now). The addresses come first: each gate closes their ports as it opens."""
        self.api_addresses = list(api_addresses)
        watched = set()
        for sandbox in self.sandboxes.values():
            if sandbox.status in (SandboxStatus.RUNNING, SandboxStatus.PAUSED):
                self._open_gate(sandbox)
            sandbox.touch()
            if sandbox.family and sandbox.family.founder not in watched:
                watched.add(sandbox.family.founder)
                asyncio.get_running_loop().create_task(self._watch(sandbox.family))
        if self.sandboxes:
            self._start_auto_pauser()

    def _reap_leftovers(self, adopted: set[str]) -> None:
        """Clear what an engine that died left in this state dir and nobody took over
        (a sandbox it was still creating, or one whose processes are gone): processes,
        cgroups and files. A frozen v1 cgroup would keep its processes alive, so it is
        thawed and emptied. (Disk volumes are mounted only in their sandbox's mount
        namespace: gone with it.)"""
        stale = {entry.name for entry in os.scandir(self.sandbox_root) if entry.is_dir()} - adopted
        if not stale:
            return
        log.info("removing %d sandboxes a previous engine left behind", len(stale))
        for sandbox_id in stale:
            leftover = self.freezer.attach_existing(sandbox_id)
            if leftover is not None:
                self.freezer.kill(leftover)
                self.freezer.release(leftover)
        self.limiter.reap(stale)
        for sandbox_id in stale:
            shutil.rmtree(self.sandbox_root / sandbox_id, True)

    def _forget_old_destroyed(self) -> None:
        destroyed = [sb for sb in self.sandboxes.values() if sb.status == SandboxStatus.DESTROYED]
        for sandbox in sorted(destroyed, key=lambda sb: sb.destroyed_at or 0)[:-KEEP_DESTROYED]:
            del self.sandboxes[sandbox.id]

    def _free_name(self) -> str:
        taken = {sb.name for sb in self.sandboxes.values() if sb.status not in TERMINAL}
        while True:
            name = f"{secrets.choice(ADJECTIVES)}-{secrets.choice(ANIMALS)}-{secrets.token_hex(2)}"
            if name not in taken:
                return name

    async def close(self) -> None:
        """Stop managing the sandboxes and leave them running (or paused): the next engine
        on this state dir takes them over (registry.py). Destroying them is an explicit act.
        Commands running in execs end with an error frame (engine_shut_down): their agent
        connections close, as when a client abandons an exec; managed processes run on."""
        if self.closing:
            return
        self.closing = True
        if self._auto_pauser:
            self._auto_pauser.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._auto_pauser
        for sandbox in list(self.sandboxes.values()):
            if sandbox.transition and not sandbox.transition.done():
                with contextlib.suppress(Exception):  # a pause or resume is short: let it settle
                    await asyncio.shield(sandbox.transition)
            if sandbox.gate:
                await sandbox.gate.stop()
            if sandbox.signals:
                await sandbox.signals.stop()
            sandbox.direct_input.close()
            sandbox.agent_connections.close_all()
            self._save(sandbox)
        self._work.shutdown(wait=False, cancel_futures=True)  # its threads end with their calls

    # -- pause, resume, patch ---------------------------------------------------------

    def _settled(self, sandbox_id: str, status: SandboxStatus, to_be: str) -> LocalSandbox:
        """The sandbox, if it is in `status` with nothing in flight; else 409 (CreateOS)."""
        sandbox = self.get(sandbox_id)
        if sandbox.status != status or (sandbox.transition and not sandbox.transition.done()):
            raise Conflict(f"sandbox is {sandbox.status.value}: only a {status.value} sandbox can be "
                           f"{to_be}", code="invalid_state")
        return sandbox

    def pause(self, sandbox_id: str) -> LocalSandbox:
        """Start pausing (status `pausing`, like CreateOS); a task freezes it. The API
        answers once that is done or a moment has passed (settled_soon)."""
        sandbox = self._settled(sandbox_id, SandboxStatus.RUNNING, "paused")
        self._begin(sandbox, SandboxStatus.PAUSING, self._freeze(sandbox))
        return sandbox

    def resume(self, sandbox_id: str) -> LocalSandbox:
        sandbox = self._settled(sandbox_id, SandboxStatus.PAUSED, "resumed")
        self._begin(sandbox, SandboxStatus.RESUMING, self._thaw(sandbox))
        return sandbox

    def fork(self, source_id: str, request: ForkSandboxRequest) -> LocalSandbox:
        """Start a fork (answer the child in `forking`, like CreateOS); a task makes it."""
        source = self._settled(source_id, SandboxStatus.PAUSED, "forked")
        refuse_unsupported(request)
        child_id = new_sandbox_id()
        child = LocalSandbox(
            id=child_id, name=self._free_name(), shape=source.shape,
            dirs=SandboxDirs(self.sandbox_root / child_id),
            envs=dict(source.envs if request.envs is None else request.envs),
            egress=list(source.egress) if request.egress is None else checked_egress(request.egress),
            auto_pause_after_seconds=source.auto_pause_after_seconds, disk_mib=source.disk_mib,
            rootfs=source.rootfs, family=source.family, forked_from=source.id,
            host_user=source.host_user)
        assert source.family is not None
        source.family.members.add(child.id)
        self.sandboxes[child.id] = child
        self._begin(child, SandboxStatus.FORKING, self._fork(source, child, bool(request.start_paused)))
        source.transition = child.transition  # the source is busy until the fork is done
        return child

    async def _fork(self, source: LocalSandbox, child: LocalSandbox, start_paused: bool) -> None:
        """Copy the paused source into the child: its agent forks a process that becomes
        the child sandbox (new namespaces, copied files; see guest/nsfork.py), and the
        runner forks itself into it, live Python state and all. The source is thawed
        for the few milliseconds this takes, then paused again: while the child's agent
        starts (a new interpreter, the longest step), so the two overlap. The fork is done,
        and the source free again, once both are."""
        assert source.freezer and source.frozen and source.family
        started = time.monotonic()
        child.dirs.root.mkdir(mode=0o700)  # so an engine restart finds what it left
        child.dirs.agent.mkdir(mode=0o700)
        refreeze: asyncio.Future | None = None
        try:
            # The child's agent serves a socket bound here, handed over with the request:
            # the engine reaches it as it reaches a founder's, in a host dir of its own.
            with self._agent_listener(child.dirs) as listener:  # the child's agent keeps its own copy
                await self._blocking(source, source.freezer.thaw, source.frozen)
                try:
                    reply = await source.agent.fork(hostname="sandbox",
                                                    disk_mib=child.disk_mib,
                                                    env={"SANDBOX_ID": child.id}, listener=listener)
                    agent_pid = source.family.host_pid(reply["pid"])
                    followers = [source.family.host_pid(pid) for pid in reply[protocol.FOLLOWERS]]
                    source.family.check_fork_members(agent_pid, followers)
                    self._attach(child, agent_pid, *followers)
                finally:
                    refreeze = asyncio.ensure_future(
                        self._blocking(source, source.freezer.freeze, source.frozen))
            await self._wait_for_agent(child)
            await refreeze
            self._open_gate(child)
            if start_paused:
                await self._blocking(child, child.freezer.freeze, child.frozen)
                child.paused_at = time.time()
        except Exception as exc:  # noqa: BLE001 - reported as the child's state
            log.warning("fork of %s failed: %s", source.id, exc)
            if refreeze is not None:  # the source is settled before its fork ends
                await asyncio.gather(refreeze, return_exceptions=True)
            child.status = SandboxStatus.FAILED
            await self._stop(child)
            return
        child.spawn_ms = int((time.monotonic() - started) * 1000)
        child.running_at = time.time()
        child.status = SandboxStatus.PAUSED if start_paused else SandboxStatus.RUNNING
        self._save(child)
        log.info("sandbox %s forked from %s (%d ms)", child.id, source.id, child.spawn_ms)

    def _open_gate(self, sandbox: LocalSandbox) -> None:
        """Connect the running sandbox's agent to the world: egress, and its self-signals."""
        sandbox.gate = EgressGate(lambda: sandbox.agent, lambda: sandbox.egress,
                                  [port for _, port in self.api_addresses])
        sandbox.gate.start()
        sandbox.signals = SignalRelay(lambda: sandbox.agent,
                                      lambda action, reason: self._self_signal(sandbox, action, reason))
        sandbox.signals.start()

    async def _self_signal(self, sandbox: LocalSandbox, action: str, reason: str) -> None:
        """A sandbox asked to pause or delete itself (as the owner's pause/DELETE would)."""
        log.info("sandbox %s asks to %s itself (reason %r)", sandbox.id, action, reason)
        if action == "pause":
            with contextlib.suppress(EngineError):  # e.g. already pausing
                self.pause(sandbox.id)
        else:  # in a task of its own: destroying stops this relay, which awaits us
            task = asyncio.get_running_loop().create_task(self._destroy_if_live(sandbox.id))
            self._background.add(task)  # the loop keeps only weak references
            task.add_done_callback(self._background.discard)

    async def _destroy_if_live(self, sandbox_id: str) -> None:
        with contextlib.suppress(EngineError):  # e.g. already being destroyed
            await self.destroy(sandbox_id)

    def set_egress(self, sandbox_id: str, rules: list[str] | None) -> LocalSandbox:
        """Replace the whole rule list at once; the next connection already obeys it."""
        sandbox = self.get(sandbox_id)
        if sandbox.status in TERMINAL or sandbox.status == SandboxStatus.DESTROYING:
            raise NotFound("sandbox not found", code="sandbox_not_found")
        sandbox.egress = checked_egress(rules)
        if sandbox.gate:
            sandbox.gate.rules_changed()
        self._save(sandbox)
        return sandbox

    def patch(self, sandbox_id: str, request: PatchSandboxRequest) -> LocalSandbox:
        sandbox = self.get(sandbox_id)
        refuse_unsupported(request)
        if sandbox.status in TERMINAL or sandbox.status == SandboxStatus.DESTROYING:
            raise Conflict(f"sandbox is {sandbox.status.value}", code="invalid_state")
        if request.disable_auto_pause:
            sandbox.auto_pause_after_seconds = None
        elif request.auto_pause_after_seconds is not None:
            sandbox.auto_pause_after_seconds = request.auto_pause_after_seconds
            sandbox.touch()  # the new timeout counts from now
        self._save(sandbox)
        return sandbox

    async def settled_soon(self, sandbox: LocalSandbox, within: float = ANSWER_SETTLED_WITHIN) -> LocalSandbox:
        """The sandbox once its pause, resume or making by a fork just begun is done, or
        once `within` seconds have passed (the work goes on: a request's end cancels no
        freeze, nor a fork)."""
        if sandbox.transition is not None:
            await asyncio.wait({sandbox.transition}, timeout=within)
        return sandbox

    def _begin(self, sandbox: LocalSandbox, status: SandboxStatus, work) -> None:  # type: ignore[no-untyped-def]
        sandbox.status = status
        sandbox.transition = asyncio.get_running_loop().create_task(work)

    async def _freeze(self, sandbox: LocalSandbox) -> None:
        assert sandbox.freezer and sandbox.frozen
        try:
            await self._blocking(sandbox, sandbox.freezer.freeze, sandbox.frozen)
        except Exception as exc:  # noqa: BLE001 - the freezer thawed it again
            log.warning("sandbox %s could not be paused: %s", sandbox.id, exc)
            if sandbox.status == SandboxStatus.PAUSING:
                sandbox.status = SandboxStatus.RUNNING
            return
        if sandbox.status == SandboxStatus.PAUSING:
            sandbox.status = SandboxStatus.PAUSED
            sandbox.paused_at = time.time()
            self._save(sandbox)
            log.info("sandbox %s paused", sandbox.id)

    async def _thaw(self, sandbox: LocalSandbox) -> None:
        assert sandbox.freezer and sandbox.frozen
        try:
            await self._blocking(sandbox, sandbox.freezer.thaw, sandbox.frozen)
        except Exception as exc:  # noqa: BLE001
            log.warning("sandbox %s could not be resumed: %s", sandbox.id, exc)
            if sandbox.status == SandboxStatus.RESUMING:
                sandbox.status = SandboxStatus.ERROR
            return
        if sandbox.status == SandboxStatus.RESUMING:
            sandbox.status = SandboxStatus.RUNNING
            sandbox.last_resumed_at = time.time()
            sandbox.touch()  # auto-pause counts from the resume, not from before the pause
            self._save(sandbox)
            log.info("sandbox %s resumed", sandbox.id)

    def _start_auto_pauser(self) -> None:
        if self._auto_pauser is None or self._auto_pauser.done():
            self._auto_pauser = asyncio.get_running_loop().create_task(self._auto_pause_loop())

    async def _auto_pause_loop(self) -> None:
        second = auto_pause_second()
        while True:
            await asyncio.sleep(AUTO_PAUSE_CHECK_SECONDS * second)
            for sandbox in list(self.sandboxes.values()):
                limit = sandbox.auto_pause_after_seconds
                if (limit and sandbox.status == SandboxStatus.RUNNING
                        and sandbox.idle_for() >= limit * second):
                    log.info("sandbox %s idle for %.0f s: auto-pausing", sandbox.id,
                             sandbox.idle_for())
                    with contextlib.suppress(EngineError):
                        self.pause(sandbox.id)

    # -- work inside a sandbox --------------------------------------------------------

    def check_exec(self, sandbox_id: str, cmd: str, args: list[str],
                   env: dict[str, str] | None = None) -> None:
        """400 for a command the sandbox's agent would refuse for its size (before any
        stream starts, so the answer is a JSend error)."""
        sandbox = self.running(sandbox_id)
        try:
            encoded(exec_request(cmd, args, {**sandbox.envs, **(env or {})}))
        except RequestTooLarge as exc:
            raise InvalidRequest(f"exec arguments too large: {exc}", code="request_too_large") from None

    async def exec(self, sandbox_id: str, cmd: str, args: list[str], stdin: str = "",
                   env: dict[str, str] | None = None) -> AsyncIterator[dict]:
        """Yield CreateOS exec frames; closing the iterator early kills the command. `stdin`
        is its whole standard input; `env` is added to the sandbox's envs (and wins). Raises
        an EngineError saying why if the command is cut off (sandbox destroyed, engine
        shutting down, agent gone) before its exit code."""
        sandbox = self.running(sandbox_id)
        sandbox.active_execs += 1  # a running command is activity for its whole duration
        sandbox.touch()
        exited = False
        try:
            async for frame in sandbox.agent.exec(cmd, args, {**sandbox.envs, **(env or {})}, stdin):
                exited = exited or "exit_code" in frame
                yield frame
        except (AgentUnavailable, ConnectionError, ValueError):
            pass
        finally:
            sandbox.active_execs -= 1
            sandbox.touch()
        if not exited:  # the agent went away mid-command
            raise self.why_exec_ended(sandbox)

    def why_exec_ended(self, sandbox: LocalSandbox) -> EngineError:
        """Why a command's agent connection ended before the command did."""
        if self.closing:  # a 500, not a 503: clients would retry the command on a 503
            return EngineStopped("the local engine shut down while the command ran",
                                 code="engine_shut_down")
        if sandbox.status in (SandboxStatus.DESTROYING, SandboxStatus.DESTROYED):
            return Conflict("the sandbox was destroyed while the command ran", code="sandbox_destroyed")
        return AgentLost("sandbox agent is not reachable", code="agent_unreachable")

    async def write_file(self, sandbox_id: str, path: str, chunks: AsyncIterator[bytes],
                         size: int | None) -> int:
        """Stream an upload of `size` bytes (None: unknown) into the sandbox."""
        sandbox = self.running(sandbox_id)
        sandbox.touch()
        if size is not None and size > sandbox.disk_mib * 1024 * 1024:
            raise TooLarge(f"{path}: {size} bytes do not fit the sandbox's {sandbox.disk_mib} MiB disk",
                           code="disk_full")
        with file_errors():
            return await sandbox.agent.write_file(path, chunks, size)

    @contextlib.asynccontextmanager
    async def read_file(self, sandbox_id: str, path: str) -> AsyncIterator[tuple[int, AsyncIterator[bytes]]]:
        """(size, chunks) of a file in the sandbox, streamed while the context is open."""
        sandbox = self.running(sandbox_id)
        sandbox.touch()
        with file_errors():
            async with sandbox.agent.read_file(path) as (size, chunks):
                yield size, chunks


@contextlib.contextmanager
def file_errors() -> Iterator[None]:
    """The agent's file errors as the HTTP errors CreateOS answers."""
    try:
        yield
    except AgentError as exc:
        if exc.code == "not_found":
            raise NotFound(str(exc), code="file_not_found") from None
        if exc.code == "no_space":
            raise TooLarge(f"{exc} (the sandbox's disk is full)", code="disk_full") from None
        raise InvalidRequest(str(exc), code=exc.code) from None

