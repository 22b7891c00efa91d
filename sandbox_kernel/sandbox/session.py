"""One notebook's sandbox: create or attach, start the runner, run cells, shut down.

Everything here goes through SandboxClient (the CreateOS REST API); nothing touches a
process or file of the sandbox directly, so the same code drives CreateOS and the local
engine. The runner (runner.py) is uploaded at start and run as a daemon holding the
user's globals. The kernel talks to it over one duplex channel (channel.py: a managed
process relaying requests and events) where the provider has managed processes; where
it has not (decided once, at the first start), by one exec per request
(exec_transport.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from sandbox_kernel.api import (
    ConflictError,
    CreateSandboxRequest,
    EgressView,
    ExecResponse,
    ExecResult,
    ForkSandboxRequest,
    NotFoundError,
    PatchSandboxRequest,
    SandboxAPIError,
    SandboxClient,
    SandboxStatus,
    SandboxView,
)
from sandbox_kernel.api import names
from sandbox_kernel.sandbox import ownership, pool, shutdown_policy
from sandbox_kernel.guest import runner_bundle, runner_protocol as protocol
from sandbox_kernel.sandbox.channel import ChannelError, ChannelUnavailable, RunnerChannel, SandboxProcesses
from sandbox_kernel.sandbox.exec_transport import ExecFailed, ExecTransport, RunnerGone, encode_arg
from sandbox_kernel.config import Settings, open_client
from sandbox_kernel.sandbox.cost import Cost, Meter
from sandbox_kernel.sandbox.early_start import EarlyStart

log = logging.getLogger("sandbox_kernel.sandbox.session")

RUNNER_DIR = "/tmp/sandbox-kernel"
RUNNER_PATH = f"{RUNNER_DIR}/runner.py"
RUNNER_CLIENT_PATH = f"{RUNNER_DIR}/runner_client.py"
# Uploaded at every runner start: the runner's bundle (the daemon, its modules, its light
# client), whose hash the runner reports (runner_bundle.py).
RUNNER_FILES = {f"{RUNNER_DIR}/{name}": Path(runner_bundle.__file__).with_name(name) for name in runner_bundle.FILES}
SANDBOX_PYTHON = "python3"
# Keep each exec argument well under Linux's 128 KiB per-argument limit.
MAX_INLINE_CODE = 64 * 1024
RUNNER_READY_TIMEOUT = 30.0
READY_PROBE = 2.0  # seconds one readiness exec may wait in the sandbox
PROBE_INTERVAL = 0.01  # seconds between its looks for the runner's ready file
NOT_READY_YET = 3  # its exit status when the runner is still starting
# The runner's events are lines on its client's stdout, which code in the sandbox can
# replace: a line longer than the cell's output limit plus this is dropped, never held.
EVENT_LINE_SLACK = 1024 * 1024

# A fork made from a notebook pauses after this long idle unless the kernel sets its own
# auto-pause: a forgotten fork then costs only its memory and disk.
FORK_AUTO_PAUSE = 600

# A restarting kernel's sandboxes wait this long for the new kernel process to own them.
RESTART_HANDOFF_WAIT = 120.0

# Polling a transition (pause, resume, fork): locally it takes milliseconds, on CreateOS
# it can take minutes; doubling from 20 ms to 2 s serves both with few requests.
POLL_FIRST, POLL_MAX, TRANSITION_BUDGET = 0.02, 2.0, 900.0

EventHandler = Callable[[dict[str, Any]], Awaitable[None]]
Progress = Callable[[str], None]


class SessionError(Exception):
    """Something the notebook user should read as one line."""


class RunnerDied(SessionError):
    """The runner (the notebook's Python) died: the kernel says why and restarts, keeping
    the sandbox, as a frontend expects when a kernel's Python dies."""


def runner_client(*args: str) -> list[str]:
    """Arguments of a short-lived runner client: runner_client.py, which starts in a bare
    interpreter's time (no site-packages, only built-in modules), once per cell."""
    return ["-I", "-S", RUNNER_CLIENT_PATH, *args]


class SandboxSession:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.client: SandboxClient | None = None
        self.sandbox_id: str | None = None
        self.runner_info: dict[str, Any] = {}
        self.boot_seconds: float | None = None
        # The transport where the provider has no managed processes (exec_transport.py).
        self.execs = ExecTransport(SANDBOX_PYTHON, lambda command, arg: runner_client(command, RUNNER_DIR, arg),
                                   settings.output_limit + EVENT_LINE_SLACK)
        # What shutdown does to every sandbox this kernel owns (ownership.py); a sandbox
        # it only attached to is its owner's business.
        self.on_shutdown = "destroy"
        self.kept: list[str] = []  # handed off with `%sandbox keep`: listed at shutdown
        # The cost meter, and every sandbox this notebook created, forked or drove.
        self.meter = Meter()
        self.known: list[str] = []
        # Topping up the warm pool after this kernel claimed from it (pool.py).
        self.pool_refill: asyncio.Task[None] | None = None
        self.making_pool_member = False
        # Local engine: the OOM kills seen in each sandbox's view (more later = the memory
        # limit killed something since).
        self.oom_kills: dict[str, int] = {}
        # The channel to the runner (channel.py), or None: one exec per request instead.
        # Whether the provider has managed processes is learnt once, at the first start.
        self.channel: RunnerChannel | None = None
        # Set once shutdown or a restart hand-off begins: a cell still running then must not
        # open a channel the closing session would leave reading on a closed client.
        self.closing = False
        self.use_channel: bool | None = None
        self.channel_sandbox = ""  # the sandbox the channel's relay runs in
        # Relays of ours left in paused sandboxes (a paused sandbox refuses the kill: a fork
        # switched to, another sandbox attached): ended when this kernel resumes their
        # sandbox, so that switching back and forth does not pile them up to the pids limit.
        self.relays_to_end: dict[str, list[RunnerChannel]] = {}
        self.open_channels = True  # False for a warm pool member: its kernel opens one later
        # False for a session started early on a thread (early_start.py): the kernel's own
        # session, which takes its sandbox over, tops the warm pool up.
        self.refill_pool = True
        # Output the runner sends between cells (a background thread's print): the kernel
        # shows it on the last cell's parent.
        self.on_background: EventHandler | None = None

    # -- start ----------------------------------------------------------------------------

    async def start(self, attach_to: str | None = None, fresh_runner: bool = True,
                    early: EarlyStart | None = None) -> None:
        """Create a sandbox, or adopt `attach_to` (keeping its runner unless fresh_runner), or
        take over the one `early` made while the kernel started (early_start.py)."""
        started = early.started if early else time.monotonic()
        try:
            if self.client is None:
                self.client = await open_client(self.settings)
            if attach_to:  # an id or a name
                await self.attach((await self.find(attach_to)).id, fresh_runner=fresh_runner)
            elif early is None or not await self._take_over(early):
                if not await self._start_from_pool():
                    await self._create()
        except SandboxAPIError as exc:
            raise SessionError(f"could not start a sandbox on {self.settings.description}: "
                               f"{exc.user_message()}") from None
        except (OSError, RuntimeError) as exc:
            raise SessionError(f"could not start a sandbox on {self.settings.description}: {exc}") from None
        self.boot_seconds = time.monotonic() - started

    async def _create(self) -> None:
        client = self._client()
        # Named by us, so that a kernel stopped before the create returns still leaves a
        # trace that shutdown and `gc` can follow to the sandbox (ownership.creating).
        name = self.settings.name or f"notebook-{secrets.token_hex(4)}"
        ownership.creating(name)
        try:
            created = await client.create_sandbox(
                CreateSandboxRequest(shape=self.settings.shape, rootfs=self.settings.rootfs, name=name,
                                     egress=self.settings.egress,
                                     auto_pause_after_seconds=self.settings.auto_pause))
        except SandboxAPIError as exc:
            if exc.status_code is not None and exc.status_code < 500:  # refused: nothing was made
                ownership.created(name, None)
            if isinstance(exc, ConflictError) and self.settings.name:
                raise SessionError(f"the name {name!r} is taken on {self.settings.description}: "
                                   "choose another (SANDBOX_KERNEL_SANDBOX_NAME)") from None
            raise
        ownership.created(name, created.id)
        self.sandbox_id = created.id
        ownership.drive(created.id)
        self._track(await client.get_sandbox(created.id))
        await self.start_runner(new_sandbox=True)

    async def _take_over(self, early: EarlyStart) -> bool:
        """Drive the sandbox made early, its runner serving (its failure is this start's);
        False if it was made for other settings."""
        if early.settings != self.settings:  # a kernel argument from a Jupyter config file
            try:
                await early.discard()
            except (SandboxAPIError, OSError, RuntimeError) as exc:  # still ours: the shutdown policy ends it
                log.warning("could not destroy the sandbox made before the kernel's settings were known: %s", exc)
            return False
        prepared = await early.prepared()
        self.sandbox_id, self.runner_info = prepared.sandbox_id, prepared.runner_info
        ownership.drive(prepared.sandbox_id)
        # Together: one round trip (30 ms and more to a provider in the cloud), not two.
        view, _ = await asyncio.gather(self._client().get_sandbox(prepared.sandbox_id), self._open_channel())
        self._track(view)
        self._refill_pool_later()
        return True

    # -- warm pool (pool.py) ----------------------------------------------------------------

    async def _start_from_pool(self) -> bool:
        """Start on a ready sandbox of the warm pool, if one is configured; True if we did.

        Either way the pool is topped up afterwards, in the background.
        """
        if not self.settings.warm_pool or self.settings.name:  # a pooled sandbox has its name already
            return False
        warm = pool.WarmPool.for_settings(self.settings, self.settings.warm_pool)
        tried: set[str] = set()
        while (member := warm.claim(tried)) is not None:  # ours from here on (ownership.py)
            tried.add(member.sandbox_id)
            try:
                await self._take_member(member.sandbox_id)
                break
            except (SessionError, SandboxAPIError, RuntimeError) as exc:  # e.g. destroyed behind our back
                log.warning("warm pool sandbox %s is unusable (%s): trying another", member.sandbox_id, exc)
                await self._drop_member(warm, member)
        self._refill_pool_later()
        return self.sandbox_id is not None

    async def _take_member(self, sandbox_id: str) -> None:
        """Drive a claimed member, with this kernel's auto-pause (the member's was the pool's
        short one); on failure the session is left without it."""
        await self.attach(sandbox_id, fresh_runner=False)
        auto_pause = self.settings.auto_pause
        try:
            await self._client().patch_sandbox(sandbox_id, PatchSandboxRequest(disable_auto_pause=True)
                                               if auto_pause is None else
                                               PatchSandboxRequest(auto_pause_after_seconds=auto_pause))
        except BaseException:
            self.sandbox_id, self.runner_info = None, {}
            with contextlib.suppress(Exception):  # its relay: ended with the sandbox if not now
                await self._stop_channel(kill=True)
            raise

    async def _drop_member(self, warm: pool.WarmPool, member: pool.Member) -> None:
        """A claimed member this kernel cannot use is destroyed, or, if even that fails,
        given back to the pool: never left without an owner."""
        try:
            await self.destroy(member.sandbox_id)
        except NotFoundError:  # gone already
            ownership.forget(member.sandbox_id)
        except (SandboxAPIError, OSError, RuntimeError) as exc:
            log.warning("could not destroy warm pool sandbox %s (%s): back to the pool", member.sandbox_id, exc)
            warm.give_back(member)

    def _refill_pool_later(self) -> None:
        """Top the warm pool up in the background, if one is configured."""
        if self.settings.warm_pool and not self.settings.name and self.refill_pool:
            warm = pool.WarmPool.for_settings(self.settings, self.settings.warm_pool)
            self.pool_refill = asyncio.get_running_loop().create_task(self._refill_later(warm))

    async def _refill_later(self, warm: pool.WarmPool) -> None:
        # Let this notebook's first cells have the CPU before sandboxes are made for others.
        await asyncio.sleep(pool.REFILL_DELAY)
        await warm.refill(self._make_pool_member)

    async def _make_pool_member(self) -> str:
        """A new sandbox with its runner started, claimed by this kernel until it is pooled."""
        member = SandboxSession(replace(self.settings, auto_pause=pool.MEMBER_AUTO_PAUSE, warm_pool=0,
                                        name=None))
        member.client = self._client()
        member.open_channels = False
        self.making_pool_member = True
        try:
            await member._create()
        except BaseException:
            if member.sandbox_id:  # half made: do not leave it behind
                with contextlib.suppress(Exception):
                    await asyncio.shield(member.destroy(member.sandbox_id))
            raise
        finally:
            self.making_pool_member = False
        assert member.sandbox_id is not None
        return member.sandbox_id

    async def _stop_refill(self) -> None:
        """Before the client closes: drop a pending top-up, or let a member being made finish."""
        task = self.pool_refill
        if task is None or task.done():
            return
        if not self.making_pool_member:
            task.cancel()
        # Past this wait the kernel goes anyway; its half-made member stays claimed by
        # this (then dead) kernel, so `sandbox-kernel gc` destroys it.
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(asyncio.shield(task), pool.REFILL_SHUTDOWN_WAIT)

    async def attach(self, sandbox_id: str, fresh_runner: bool = False,
                     progress: Progress | None = None) -> bool:
        """Drive `sandbox_id` from now on; return True if its running runner was kept.

        A runner already alive in it (a fork's, or another notebook's) is kept with its
        state, unless fresh_runner asks for a new one; even one of another bundle (another
        sandbox-kernel version, see other_version_line): its variables are the user's.
        """
        client = self._client()
        view = self._track(await client.get_sandbox(sandbox_id))
        if not _can_run_cells(view.status):
            raise _cannot_run_cells(view)
        previous = (self.sandbox_id, self.runner_info)
        self.sandbox_id = view.id
        ownership.use(view.id)
        ownership.drive(view.id)
        try:
            if view.status != SandboxStatus.RUNNING:
                await self.wake(progress)
            if not fresh_runner:
                try:
                    info = await self._exec_request({protocol.OP: protocol.INFO})
                except (SessionError, ValueError):  # ValueError: an answer that is not JSON
                    info = {}
                # Anything else than a runner's info (the sandbox's code can replace its
                # client) is no runner this kernel can drive: a new one is started.
                if isinstance(info, dict) and "python_version" in info:
                    self.runner_info = info
                    await self._open_channel()
                    return True
            await self.start_runner()
            return False
        except BaseException:  # a failed attach leaves the notebook on its sandbox
            self.sandbox_id, self.runner_info = previous
            raise

    def other_version_line(self) -> str | None:
        """One line for the user if the runner this session drives was started from another
        bundle than this kernel's (an older sandbox-kernel's runner reports none), else None."""
        if not self.runner_info or runner_bundle.runs_this_bundle(self.runner_info):
            return None
        return (f"Sandbox {self.sandbox_id} runs a Python runner of another sandbox-kernel version, kept with "
                f"its variables; `%sandbox attach {self.sandbox_id} --restart-runner` starts this "
                "version's (variables and imports are lost, files are kept)")

    async def start_runner(self, new_sandbox: bool = False) -> None:
        """Upload the runner's files and start its daemon; an older daemon is stopped first
        (none in a new_sandbox: we just made it)."""
        client, sandbox_id = self._require()
        self._check(await client.exec(sandbox_id, "mkdir", ["-p", RUNNER_DIR]))
        await asyncio.gather(*(client.upload_file(sandbox_id, path, source.read_bytes())
                               for path, source in RUNNER_FILES.items()))
        # Detached, so the exec returns at once; `;` (not &&) so the start never waits on
        # the shutdown of a daemon that is not there.
        stop_old = " ".join([SANDBOX_PYTHON, *runner_client("request", RUNNER_DIR, encode_arg({protocol.OP: protocol.SHUTDOWN}))])
        # Under a shell that records how the daemon ended (its exit status; 128+N: signal N),
        # in a file named by that shell's pid, so that a daemon stopped earlier cannot answer for it.
        start = ("" if new_sandbox else f"{stop_old} >/dev/null 2>&1; rm -f {RUNNER_DIR}/ready; ") + (
            f"nohup setsid sh -c '{SANDBOX_PYTHON} {RUNNER_PATH} serve {RUNNER_DIR}; "
            f"echo $? >{RUNNER_DIR}/runner.exit.$$' "
            f"</dev/null >{RUNNER_DIR}/runner.log 2>&1 & echo $! >{RUNNER_DIR}/runner.pid")
        # Readiness by short execs, none held longer than READY_PROBE (a gateway may cut
        # long ones); a runner that died (no python3, a crash) is reported at once. The
        # first one also starts the runner: one round trip less (30 ms each in the cloud).
        # Each look costs one process (sleep), which takes CPU from the starting runner.
        probe = (f"pid=$(cat {RUNNER_DIR}/runner.pid); i=0; while [ $i -lt {int(READY_PROBE / PROBE_INTERVAL)} ]; do "
                 f"[ -f {RUNNER_DIR}/ready ] && exec cat {RUNNER_DIR}/ready; "
                 f"kill -0 $pid 2>/dev/null || "
                 f"{{ tail -n 20 {RUNNER_DIR}/runner.log >&2; exit 1; }}; "
                 f"i=$((i+1)); sleep {PROBE_INTERVAL}; done; exit {NOT_READY_YET}")
        deadline = time.monotonic() + RUNNER_READY_TIMEOUT
        script = f"{start}; {probe}"
        while True:
            response = await client.exec(sandbox_id, "sh", ["-c", script])
            if response.result.exit_code != NOT_READY_YET or time.monotonic() > deadline:
                break
            script = probe
        result = self._check(response, what="the Python runner did not start")
        self.runner_info = json.loads(result.stdout)
        await self._open_channel()

    async def _open_channel(self, background_seq: int = 0) -> None:
        """Open the channel to the runner now serving in this sandbox, replacing any other
        (a background_seq: the same runner, whose between-cell output we saw up to it)."""
        if not self.open_channels or self.use_channel is False:
            return
        client, sandbox_id = self._require()
        channel = RunnerChannel(
            SandboxProcesses(client, sandbox_id, SANDBOX_PYTHON),
            lambda after: runner_client("channel", RUNNER_DIR, *([str(after)] if after else [])),
            self.settings.output_limit + EVENT_LINE_SLACK, self._background_event, background_seq=background_seq)
        try:
            await channel.open()
            if self.closing:
                await channel.close()
                raise SessionError("the kernel is shutting down")
        except ChannelUnavailable as exc:
            if self.use_channel:
                raise RuntimeError(f"the runner's channel could not start: {exc}") from None
            log.warning("no managed processes (%s): one exec per cell", exc)
            self.use_channel = False
            return
        self.use_channel = True
        old, old_sandbox = self.channel, self.channel_sandbox
        self.channel, self.channel_sandbox = channel, sandbox_id
        if old is not None and not await old.close():
            self.relays_to_end.setdefault(old_sandbox, []).append(old)

    def egress_refusals_hint(self) -> int | None:
        """The engine's count of egress refusals as its stream last said (None: no channel).
        Only a cue to ask (channel.py); it means something only where the engine counts
        refusals at all (its egress view has denied_count: the local engine)."""
        if self.channel is None or self.channel_sandbox != self.sandbox_id:
            return None
        return self.channel.egress_refusals

    async def _background_event(self, event: dict[str, Any]) -> None:
        if self.on_background is not None:
            await self.on_background(event)

    @staticmethod
    def _check(response: ExecResponse, what: str = "sandbox command failed") -> ExecResult:
        result = response.result
        if result.exit_code != 0 or result.error:
            detail = (result.error or result.stderr).strip().splitlines()
            raise RuntimeError(f"{what}: {detail[-1] if detail else f'exit {result.exit_code}'}")
        return result

    def _require(self) -> tuple[SandboxClient, str]:
        if self.sandbox_id is None:
            raise SessionError("no sandbox: the session has not started")
        return self._client(), self.sandbox_id

    def _client(self) -> SandboxClient:
        if self.client is None:
            raise SessionError("no sandbox: the session has not started")
        return self.client

    # -- lifecycle ------------------------------------------------------------------------

    async def view(self) -> SandboxView:
        client, sandbox_id = self._require()
        return self._track(await client.get_sandbox(sandbox_id))

    def _track(self, view: SandboxView) -> SandboxView:
        """Remember a sandbox this notebook uses, and feed the cost meter its history."""
        if view.id not in self.known:
            self.known.append(view.id)
        if view.oom_kills is not None:
            self.oom_kills[view.id] = view.oom_kills
        self.meter.observe(view)
        return view

    async def costs(self) -> list[Cost]:
        """What every sandbox of this notebook has cost so far (on CreateOS prices)."""
        client = self._client()
        for sandbox_id in self.known:
            try:
                self._track(await client.get_sandbox(sandbox_id))
            except NotFoundError:  # CreateOS may forget a destroyed sandbox
                self.meter.note_gone(sandbox_id)
        return [self.meter.cost(sandbox_id) for sandbox_id in self.known]

    async def list_sandboxes(self) -> list[SandboxView]:
        return await self._client().list_sandboxes()

    async def get_egress(self) -> EgressView:
        client, sandbox_id = self._require()
        return await client.get_egress(sandbox_id)

    async def set_egress(self, rules: list[str]) -> EgressView:
        """Replace the sandbox's whole egress rule list ([] allows all public destinations)."""
        client, sandbox_id = self._require()
        return await client.set_egress(sandbox_id, rules)

    async def pause(self, progress: Progress | None = None) -> SandboxView:
        client, sandbox_id = self._require()
        await client.pause_sandbox(sandbox_id)
        return await self._settle(sandbox_id, SandboxStatus.PAUSED, progress)

    async def resume(self, progress: Progress | None = None) -> SandboxView:
        """`%sandbox resume`: wake this sandbox (one running already is refused)."""
        view = await self.view()
        if view.status == SandboxStatus.RUNNING:
            raise SessionError(f"sandbox {view.id} is running: there is nothing to resume")
        return await self.wake(progress)

    async def wake(self, progress: Progress | None = None) -> SandboxView:
        """Bring this sandbox to running, whatever transition it is in: CreateOS answers a
        resume 409 until the sandbox is paused (§4.2), and on CreateOS an auto-pause of a
        large VM takes seconds, so a sandbox pausing, resuming or being forked is waited
        for, and a paused one resumed. One running already is left as it is."""
        client, sandbox_id = self._require()
        async with contextlib.aclosing(self._watch(sandbox_id, progress)) as views:
            async for view in views:
                if view.status == SandboxStatus.RUNNING:
                    break
                if view.status == SandboxStatus.PAUSED:
                    with contextlib.suppress(ConflictError):  # still busy: a fork of it under way
                        await client.resume_sandbox(sandbox_id)
        for relay in self.relays_to_end.pop(sandbox_id, []):
            await relay.close()
        return view

    async def fork(self, name: str | None = None, progress: Progress | None = None,
                   on_pause: Progress | None = None) -> SandboxView:
        """Fork this sandbox (live memory and files); return the running child.

        CreateOS forks only paused sandboxes, so a running one is paused first
        (on_pause hears about it). The parent stays paused; the next cell resumes it.
        """
        client, sandbox_id = self._require()
        source = await self.view()
        try:
            envs = names.fork_envs(source, name)
            if name and (holder := names.taken_by(await client.list_sandboxes(), names.checked(name))):
                raise SessionError(f"the name {name!r} is taken by sandbox {holder.id} on "
                                   f"{self.settings.description}: choose another")
        except names.SandboxNameError as exc:
            raise SessionError(str(exc)) from None
        if source.status != SandboxStatus.PAUSED:
            if on_pause:
                on_pause(f"Pausing sandbox {sandbox_id} first: only a paused sandbox can be forked")
            await self.pause(progress)
        child = await client.fork_sandbox(sandbox_id, ForkSandboxRequest(envs=envs))
        ownership.own(child.id)  # at once: a kernel killed now leaves it to gc, not to nobody
        view = await self._settle(child.id, SandboxStatus.RUNNING, progress)
        if view.auto_pause_after_seconds is None:
            view = self._track(await client.patch_sandbox(view.id, PatchSandboxRequest(
                auto_pause_after_seconds=self.settings.auto_pause or FORK_AUTO_PAUSE)))
        return view

    async def find(self, ref: str) -> SandboxView:
        """The sandbox an id or a name designates, from any notebook (names.py)."""
        found = names.lookup(await self.list_sandboxes(), ref)
        try:
            # Not listed (destroyed, say): its id may still answer, with its state.
            return self._track(await self._client().get_sandbox(ref)) if not found else \
                names.resolve(found, ref, self.settings.description)
        except names.SandboxNameError as exc:
            raise SessionError(str(exc)) from None
        except NotFoundError:
            raise SessionError(f"no sandbox with id or name {ref!r} on {self.settings.description}") from None

    async def _settle(self, sandbox_id: str, target: SandboxStatus,
                      progress: Progress | None) -> SandboxView:
        """Poll until the sandbox reaches `target`, reporting progress; fail on a dead end."""
        async with contextlib.aclosing(self._watch(sandbox_id, progress)) as views:
            async for view in views:
                if view.status == target:
                    break
        return view

    async def _watch(self, sandbox_id: str, progress: Progress | None) -> AsyncIterator[SandboxView]:
        """The sandbox's view, looked at again (less and less often, with progress) for as
        long as the caller waits; a dead end (gone, broken) or a wait past the budget raises."""
        client = self._client()
        started = time.monotonic()
        delay = POLL_FIRST
        while True:
            view = self._track(await client.get_sandbox(sandbox_id))
            yield view
            if not _can_run_cells(view.status):
                raise SessionError(f"sandbox {view.id} is {view.status.value}")
            waited = time.monotonic() - started
            if waited > TRANSITION_BUDGET:
                raise SessionError(f"sandbox {view.id} is still {view.status.value} "
                                   f"after {TRANSITION_BUDGET:.0f} s")
            if progress:
                progress(f"({view.status.value}, {waited:.0f} s)")
            await asyncio.sleep(delay)
            delay = min(delay * 2, POLL_MAX)

    # -- cells ----------------------------------------------------------------------------

    async def run_cell(self, cell_id: str, code: str, on_event: EventHandler, *,
                       silent: bool = False, store_history: bool = True,
                       execution_count: int | None = None,
                       on_resume: Callable[[], Progress] | None = None,
                       fields: dict[str, Any] | None = None) -> dict[str, Any]:
        """Run one cell, calling on_event for every event in order; return its done event.

        fields: more of the execute_request for the runner (allow_stdin, user_expressions).

        A sandbox that is not running (CreateOS answers 409 to an exec on it) is woken
        first: paused, resumed; pausing, resuming or being forked, waited for (wake).
        on_resume() is called then, and gives the progress callback for the wait.
        """
        kwargs = dict(silent=silent, store_history=store_history, execution_count=execution_count,
                      fields=fields or {})
        try:
            return await self._run_cell(cell_id, code, on_event, **kwargs)
        except ConflictError:
            view = await self.view()
            if not _can_run_cells(view.status):
                raise _cannot_run_cells(view) from None
        if view.status != SandboxStatus.RUNNING:  # (else a resume under way ended since the 409)
            progress = on_resume() if on_resume else None
            started = time.monotonic()
            await self.wake(progress)
            if progress:
                progress(f"resumed in {time.monotonic() - started:.1f} s")
        return await self._run_cell(cell_id, code, on_event, **kwargs)

    async def _run_cell(self, cell_id: str, code: str, on_event: EventHandler, *, silent: bool,
                        store_history: bool, execution_count: int | None,
                        fields: dict[str, Any]) -> dict[str, Any]:
        client, sandbox_id = self._require()
        await self._channel_up()
        request: dict[str, Any] = {**fields, protocol.CELL_ID: cell_id, "silent": silent,
                                   "store_history": store_history,
                                   # the runner caps and paces the cell's output with these
                                   "output_limit": self.settings.output_limit,
                                   "output_rate": self.settings.output_rate}
        if execution_count is not None:
            request["execution_count"] = execution_count
        if len(code.encode()) > MAX_INLINE_CODE:
            code_file = f"{RUNNER_DIR}/{cell_id}.py"
            await client.upload_file(sandbox_id, code_file, code.encode())
            request["code_file"] = code_file
        else:
            request["code"] = code
        if self.channel is not None:
            try:
                return await self.channel.run_cell(cell_id, request, on_event)
            except ChannelError as exc:
                if exc.runner_gone:
                    raise await self._runner_died(exc) from None
                raise SessionError(str(exc)) from None
        try:
            return await self.execs.run_cell(client, sandbox_id, request, on_event)
        except RunnerGone as exc:
            raise await self._runner_died(exc) from None
        except ExecFailed as exc:
            raise SessionError(str(exc)) from None

    async def _runner_died(self, exc: Exception) -> SessionError:
        """Why the runner died, as a RunnerDied for the kernel to say before it restarts (as a
        kernel whose Python dies is restarted): the memory limit, if the sandbox's OOM kill
        count went up, else the signal or exit code its shell recorded. A sandbox that is
        gone says so instead (no runner can start there again)."""
        log.warning("the runner died: %s", exc)
        seen = self.oom_kills.get(self.sandbox_id or "", 0)
        view = await self.view()
        if view.status.is_gone:
            return _sandbox_gone(view)
        if (view.oom_kills or 0) > seen:
            cause = f"killed at the memory limit of {view.mem_mib} MiB"
        else:
            cause = await self._runner_exit() or str(exc)
        return RunnerDied(f"the Python in the sandbox died ({cause}); the kernel restarts in the same "
                          "sandbox: variables and imports are gone, files are kept")

    async def _runner_exit(self) -> str | None:
        """How the runner daemon ended, from its shell's record (written as it ends: waited
        for briefly); None if unknown."""
        exit_file = f"{RUNNER_DIR}/runner.exit.$(cat {RUNNER_DIR}/runner.pid)"
        script = (f"i=0; while [ ! -f {exit_file} ] && [ $i -lt 100 ]; do sleep 0.01; i=$((i+1)); done; "
                  f"cat {exit_file}")
        try:
            client, sandbox_id = self._require()
            status = int((await client.exec(sandbox_id, "sh", ["-c", script])).result.stdout.strip())
        except (SandboxAPIError, SessionError, ValueError) as exc:
            log.warning("how the runner ended is not known: %s", exc)
            return None
        if status > 128 and (name := _signal_name(status - 128)):
            return f"killed by {name}"
        return f"exit code {status}"

    async def _channel_up(self) -> None:
        """Before a request: a channel that ended is opened again (its runner died: RunnerDied)."""
        channel = self.channel
        if channel is None or channel.alive or self.closing:
            return
        if channel.failure is not None and channel.failure.runner_gone:
            raise await self._runner_died(channel.failure)
        await self._open_channel(channel.background_seq)  # only the connection was lost

    async def runner_request(self, message: dict[str, Any]) -> dict[str, Any]:
        """One-shot runner operation with an answer (complete, inspect, info)."""
        await self._channel_up()
        if self.channel is None:
            return await self._exec_request(message)
        try:
            reply = await self.channel.request(message)
        except (ChannelError, asyncio.TimeoutError) as exc:
            raise SessionError(f"the Python runner in the sandbox is not answering ({exc})") from None
        if "error" in reply:
            raise SessionError(f"the Python runner refused {message.get('op')}: {reply['error']}")
        return reply

    async def _send(self, message: dict[str, Any]) -> None:
        """A runner request without an answer: one input line, or one exec without a channel.
        Sent even while the channel's stream is down (it does not need it)."""
        if self.channel is not None and self.channel.failure is None:
            await self.channel.send(message)
        else:
            await self._exec_request(message)

    async def _exec_request(self, message: dict[str, Any]) -> dict[str, Any]:
        """A runner request by one exec of its light client (no channel needed)."""
        client, sandbox_id = self._require()
        try:
            return await self.execs.request(client, sandbox_id, message)
        except ExecFailed as exc:
            raise SessionError(str(exc)) from None

    async def interrupt(self) -> None:
        await self._send({protocol.OP: protocol.INTERRUPT})

    async def send_input(self, cell_id: str, value: str | None) -> None:
        """Answer the pending input(); None means the frontend cannot give input (EOF)."""
        message: dict[str, Any] = {protocol.OP: protocol.INPUT, protocol.CELL_ID: cell_id, "value": value or ""}
        if value is None:
            message["eof"] = True
        await self._send(message)

    # -- end ------------------------------------------------------------------------------

    async def destroy(self, sandbox_id: str) -> None:
        await self._client().delete_sandbox(sandbox_id)
        self.meter.note_gone(sandbox_id)
        ownership.forget(sandbox_id)

    async def shutdown(self, policy: str | None = None) -> list[shutdown_policy.Kept]:
        """Close the session, applying `policy` (or on_shutdown) to every sandbox this
        kernel owns; return those kept (shutdown_policy.py)."""
        if self.client is None:
            return []
        self.closing = True
        await self._stop_refill()
        policy = policy or self.on_shutdown
        # A sandbox that outlives the kernel keeps no relay of ours (the next kernel starts its own).
        await self._stop_channel(kill=policy != "destroy")
        try:
            return await shutdown_policy.apply_policy(self.client, policy,
                                                      self.meter.prices, self.kept)
        finally:
            for sandbox_id in self.known:
                ownership.stop_using(sandbox_id)
            await self.client.aclose()
            self.client = None

    async def close_for_restart(self) -> list[str]:
        """A kernel restart: everything this kernel owns waits for its successor (which
        takes them over from the restart hand-off file); return those ids."""
        owned = ownership.owned_here()
        ownership.await_successor(owned, RESTART_HANDOFF_WAIT)
        self.closing = True
        await self._stop_refill()
        await self._stop_channel(kill=False)  # the successor's new runner ends it
        if self.client is not None:
            await self.client.aclose()
            self.client = None
        return owned

    async def _stop_channel(self, kill: bool) -> None:
        """Stop following the runner, and end its relay if `kill` (else it ends with the
        runner or the sandbox)."""
        if self.channel is not None:
            await self.channel.close(kill=kill)
            self.channel = None


def _signal_name(number: int) -> str | None:
    try:
        return signal.Signals(number).name
    except ValueError:
        return None


def _can_run_cells(status: SandboxStatus) -> bool:
    """Running, or paused or on the way there or back: the kernel wakes it, it does not give up."""
    return status == SandboxStatus.RUNNING or status.is_pause_like


def _cannot_run_cells(view: SandboxView) -> SessionError:
    return SessionError(f"sandbox {view.id} is {view.status.value}: it cannot run cells")


def _sandbox_gone(view: SandboxView) -> SessionError:
    return SessionError(f"the sandbox {view.id} is {view.status}: its Python and its files are gone; "
                        "start a new kernel for a new sandbox, or `%sandbox attach ID|NAME` another")
