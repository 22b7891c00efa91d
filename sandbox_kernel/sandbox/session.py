"""One notebook's sandbox, as the kernel sees it: start, attach, run cells, pause, resume,
fork, shut down, and the few queries the kernel needs.

Everything here goes through SandboxClient (the CreateOS REST API); nothing touches a
process or file of the sandbox directly, so the same code drives CreateOS and the local
engine. The work is done by modules with one job each: runner_setup.py starts the runner
(the daemon holding the user's globals), runner_link.py reaches it (the channel or the
exec fallback, one RunnerTransport: transport.py), pool.py, ownership.py,
shutdown_policy.py and cost.py keep the warm pool, who owns which sandbox, what shutdown
does and what it all costs. A sandbox made before the kernel's loop ran (early_start.py)
comes in as an EarlySandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

from sandbox_kernel.api import (
    ConflictError,
    CreateSandboxRequest,
    EgressDestinations,
    EgressView,
    ForkSandboxRequest,
    NotFoundError,
    PatchSandboxRequest,
    SandboxAPIError,
    SandboxClient,
    SandboxStatus,
    SandboxView,
    StatusAck,
    names,
)
from sandbox_kernel.config import SHUTDOWN_POLICIES, Settings, open_client
from sandbox_kernel.guest import bundle as runner_bundle, protocol
from sandbox_kernel.sandbox import host_pip_settings, ownership, pool, runner_setup
from sandbox_kernel.sandbox.cost import Cost, Meter, PriceBook
from sandbox_kernel.sandbox.errors import RunnerDied, SessionError
from sandbox_kernel.sandbox.runner_link import RunnerLink
from sandbox_kernel.sandbox.runner_setup import RUNNER_DIR
from sandbox_kernel.sandbox.transport import EventHandler, RunnerTransportError

if TYPE_CHECKING:  # imported where used: an early start's create waits on this module's imports
    from sandbox_kernel.sandbox.shutdown_policy import Kept
    from sandbox_kernel.sandbox.transfer import Report, Transfer

__all__ = ["EarlySandbox", "Prepared", "RESTART_HANDOFF_WAIT", "RunnerDied", "SandboxSession", "SessionError"]

log = logging.getLogger("sandbox_kernel.sandbox.session")

# Keep each exec argument well under Linux's 128 KiB per-argument limit.
MAX_INLINE_CODE = 64 * 1024
# The runner's events are lines on its client's stdout, which code in the sandbox can
# replace: a line longer than the cell's output limit plus this is dropped, never held.
EVENT_LINE_SLACK = 1024 * 1024

# A fork made from a notebook pauses after this long idle unless the kernel sets its own
# auto-pause: a forgotten fork then costs only its memory and disk.
FORK_AUTO_PAUSE = 600
# How long a cancelled fork waits for its answer, to record the child's owner (the local
# engine answers within a second; CreateOS at once, `forking`).
FORK_ANSWER_WAIT = 5.0

# A restarting kernel's sandboxes wait this long for the new kernel process to own them.
RESTART_HANDOFF_WAIT = 120.0

# Polling a transition (pause, resume, fork): locally it takes milliseconds, on CreateOS
# it can take minutes; growing from 4 ms to 2 s serves both with few requests. The first
# look again comes soon, then less and less often (on CreateOS each look is a round trip
# anyway). Growing by half each time, not doubling: a look overshoots the transition's end
# by up to half the time waited so far, not all of it (a local fork of ~150 ms was seen
# only at ~250 ms when doubling); on CreateOS that costs a few more looks per transition.
POLL_FIRST, POLL_GROWTH, POLL_MAX, TRANSITION_BUDGET = 0.004, 1.5, 2.0, 900.0

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Prepared:
    """A sandbox made for this session by another (early_start.py), its runner serving (no
    channel yet)."""

    sandbox_id: str
    runner_info: dict[str, Any]  # empty for a warm pool member's runner, not asked yet (_take_member)


class EarlySandbox(Protocol):
    """A sandbox being made before the kernel's own session started (early_start.py)."""

    started: float  # time.monotonic() when its making began: the kernel's boot time counts from it

    async def prepared_for(self, settings: Settings) -> Prepared | None:
        """The sandbox made, if it was made for `settings`; else None (it is destroyed).
        Raises what its start raised (as SandboxSession.start would)."""


class SandboxSession:
    """One notebook's sandbox; see the module docstring."""

    def __init__(self, settings: Settings, *, client: SandboxClient | None = None,
                 open_channel: bool = True, refill_pool: bool = True,
                 on_background: EventHandler | None = None,
                 on_runner_died: Callable[[RunnerDied], Awaitable[None]] | None = None) -> None:
        """client: the API client to use (else one is opened at start).

        on_background: called with the output the runner sends between cells (a background
        thread's print): the kernel shows it on the last cell's parent. on_runner_died:
        called with a runner death the channel learnt with no cell to raise it in (between
        cells): the kernel ends as for a death in a cell. (The exec fallback learns it at
        the next cell.)

        open_channel=False: the session only prepares a sandbox, its runner serving, for
        another to drive, which opens the channel to the runner on its own event loop (a
        sandbox made early, early_start.py; a warm pool member). refill_pool=False: the
        warm pool is not topped up after a start (the session that takes the sandbox over
        does it).
        """
        self._settings = settings
        self._api = client
        self._sandbox_id: str | None = None
        self._runner_info: dict[str, Any] = {}
        self._boot_seconds: float | None = None
        self._refill_pool = refill_pool
        # How requests reach the runner (runner_link.py).
        self.link = RunnerLink(self._require, settings.output_limit + EVENT_LINE_SLACK, self._background_event,
                               opens_channels=open_channel, on_runner_gone=self._runner_gone)
        # What shutdown does to every sandbox this kernel owns (ownership.py); a sandbox
        # it only attached to is its owner's business.
        self._on_shutdown = "destroy"
        self._kept: list[str] = []  # handed off with `%sandbox keep`: listed at shutdown
        # The cost meter, and every sandbox this notebook created, forked or drove.
        self._meter = Meter()
        self._known: list[str] = []
        # Topping up the warm pool after this kernel claimed from it (pool.py).
        self._pool_refill: pool.Refill | None = None
        # Local engine: the OOM kills seen in each sandbox's view (more later = the memory
        # limit killed something since).
        self._oom_kills: dict[str, int] = {}
        self._on_background = on_background
        self._on_runner_died = on_runner_died
        # The death being explained (_runner_died): one look at the sandbox per death, which
        # a cell and the channel's news may both ask about.
        self._death: tuple[RunnerTransportError, asyncio.Future[SessionError]] | None = None
        self._death_news: asyncio.Task[None] | None = None  # telling the kernel (held: a task needs a reference)

    # -- what the kernel reads (set only by the session itself) ------------------------------

    @property
    def settings(self) -> Settings:
        """What this session makes and drives sandboxes with (the kernel's configuration)."""
        return self._settings

    @property
    def sandbox_id(self) -> str | None:
        """The sandbox this session drives (None before the start, or after a failed one)."""
        return self._sandbox_id

    @property
    def runner_info(self) -> Mapping[str, Any]:
        """What the runner said of itself when this session reached it (python_version, the
        features it offers)."""
        return self._runner_info

    @property
    def boot_seconds(self) -> float | None:
        """How long the start took (None before it finished)."""
        return self._boot_seconds

    @property
    def on_shutdown(self) -> str:
        """What shutdown does to the sandboxes this kernel owns (set_on_shutdown)."""
        return self._on_shutdown

    @property
    def prices(self) -> PriceBook:
        """The CreateOS prices costs are reckoned in."""
        return self._meter.prices

    def cost_so_far(self, sandbox_id: str) -> Cost:
        """What `sandbox_id` has cost, from what this session has seen of it (costs() looks
        at every sandbox of the notebook again first)."""
        return self._meter.cost(sandbox_id)

    def transfer(self, report: Report) -> Transfer:
        """One %upload or %download with this session's sandbox (transfer.py); report hears
        its progress."""
        from sandbox_kernel.sandbox.transfer import Transfer  # a magic's: not imported at start

        client, sandbox_id = self._require()
        return Transfer(client, sandbox_id, report)

    def keep(self, sandbox_id: str) -> None:
        """Hand a sandbox of this notebook off (`%sandbox keep`): no kernel destroys it, `gc`
        leaves it alone, and shutdown lists it among what outlives the notebook."""
        ownership.keep(sandbox_id)
        self._kept.append(sandbox_id)

    def set_on_shutdown(self, policy: str) -> None:
        """What shutdown does to the sandboxes this kernel owns: one of SHUTDOWN_POLICIES."""
        if policy not in SHUTDOWN_POLICIES:
            raise ValueError(f"on-shutdown policy {policy!r} is not one of {', '.join(SHUTDOWN_POLICIES)}")
        self._on_shutdown = policy

    # -- start ----------------------------------------------------------------------------

    async def start(self, attach_to: str | None = None, fresh_runner: bool = True,
                    early: EarlySandbox | None = None) -> None:
        """Create a sandbox, or adopt `attach_to` (keeping its runner unless fresh_runner), or
        take over the one `early` made while the kernel started (early_start.py)."""
        started = early.started if early else time.monotonic()
        try:
            if self._api is None:
                self._api = await open_client(self._settings)
            if attach_to:  # an id or a name
                await self.attach((await self.find(attach_to)).id, fresh_runner=fresh_runner)
            elif early is None or not await self._take_over(early):
                if not await self._start_from_pool():
                    await self._create()
        except SandboxAPIError as exc:
            raise SessionError(f"could not start a sandbox on {self._settings.description}: "
                               f"{exc.user_message()}") from None
        except (OSError, RuntimeError) as exc:
            raise SessionError(f"could not start a sandbox on {self._settings.description}: {exc}") from None
        self._boot_seconds = time.monotonic() - started

    async def _create(self) -> None:
        client = self._client()
        # Named by us, so that a kernel stopped before the create returns still leaves a
        # trace that shutdown and `gc` can follow to the sandbox (ownership.creating).
        name = self._settings.name or f"notebook-{secrets.token_hex(4)}"
        ownership.creating(name)
        host_pip = host_pip_settings.for_sandbox(self._settings)  # the host's index and CA bundle, no credential
        try:
            created = await client.create_sandbox(
                CreateSandboxRequest(shape=self._settings.shape, rootfs=self._settings.rootfs, name=name,
                                     egress=self._settings.egress, disk_mib=self._settings.disk_mib,
                                     envs=self._sandbox_envs(host_pip) or None,
                                     auto_pause_after_seconds=self._settings.auto_pause))
        except SandboxAPIError as exc:
            if exc.status_code is not None and exc.status_code < 500:  # refused: nothing was made
                ownership.created(name, None)
            if isinstance(exc, ConflictError) and self._settings.name:
                raise SessionError(f"the name {name!r} is taken on {self._settings.description}: "
                                   "choose another (SANDBOX_KERNEL_SANDBOX_NAME)") from None
            raise
        ownership.created(name, created.id)
        self._sandbox_id = created.id
        ownership.drive(created.id)
        # At once: the sandbox runs once created, and the runner needs neither the CA copy
        # nor the view. One round trip (30 ms and more to a provider in the cloud), not three.
        # All three are waited for, whichever fails: nothing goes on behind the caller's back.
        outcomes = await asyncio.gather(host_pip_settings.upload(client, created.id, host_pip), self.view(),
                                        self._start_runner(new_sandbox=True), return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

    def _sandbox_envs(self, host_pip: host_pip_settings.HostPipSettings) -> dict[str, str]:
        """The environment a new sandbox or fork gets: the host's pip settings, then the
        variables the user hands over (SANDBOX_KERNEL_ENV, a sealed notebook's `env`)."""
        return {**host_pip.envs, **(self._settings.sandbox_env or {})}

    async def _take_over(self, early: EarlySandbox) -> bool:
        """Drive the sandbox made early, its runner serving (its failure is this start's);
        False if it was made for other settings."""
        prepared = await early.prepared_for(self._settings)
        if prepared is None:
            return False
        self._sandbox_id = prepared.sandbox_id
        ownership.drive(prepared.sandbox_id)
        # Together: one round trip (30 ms and more to a provider in the cloud), not two.
        view, _ = await asyncio.gather(self._client().get_sandbox(prepared.sandbox_id),
                                       self._reach_prepared_runner(prepared.runner_info))
        self._track(view)
        self._refill_pool_later()
        return True

    async def _reach_prepared_runner(self, known_info: dict[str, Any]) -> None:
        """Open the channel to the runner of a sandbox made early. A warm pool member's runner
        is asked for its info over that channel (see _take_member); if none answers there
        (it died while pooled), a runner is started."""
        if known_info:
            self._runner_info = known_info
            await self.link.connect()
        else:
            await self._keep_serving_runner()

    async def _keep_serving_runner(self) -> bool:
        """Reach the runner serving in the current sandbox (True), or start one where none
        answers or none this kernel can drive (False)."""
        info = await self.link.serving_runner_info()
        if info is not None:
            self._runner_info = info
            return True
        await self._start_runner()
        return False

    # -- warm pool (pool.py) ----------------------------------------------------------------

    def _warm_pool(self) -> pool.WarmPool | None:
        """The warm pool for this session's settings, if one is configured (a sandbox given
        a name is made for it alone)."""
        if not self._settings.warm_pool or self._settings.name:
            return None
        return pool.WarmPool.for_settings(self._settings, self._settings.warm_pool)

    async def _start_from_pool(self) -> bool:
        """Start on a ready sandbox of the warm pool, if one is configured; True if we did.

        Either way the pool is topped up afterwards, in the background.
        """
        warm = self._warm_pool()
        if warm is None:
            return False
        taken = await warm.claim_usable(self._take_member, self.destroy)
        self._refill_pool_later()
        return taken is not None

    async def _take_member(self, sandbox_id: str) -> None:
        """Drive a claimed member, with this kernel's auto-pause (the member's was the pool's
        short one); on failure the session is left without it. A session that opens no channel
        (the early start's) does not ask the member's runner for its info: the session taking
        the sandbox over asks over the channel it keeps (_reach_prepared_runner), where an exec
        here started one more Python in the sandbox while the kernel was importing."""
        await self.attach(sandbox_id, fresh_runner=False, ask_runner=self.link.opens_channels)
        auto_pause = self._settings.auto_pause
        try:
            await self._client().patch_sandbox(sandbox_id, PatchSandboxRequest(disable_auto_pause=True)
                                               if auto_pause is None else
                                               PatchSandboxRequest(auto_pause_after_seconds=auto_pause))
        except BaseException:
            self._sandbox_id, self._runner_info = None, {}
            with contextlib.suppress(Exception):  # its relay: ended with the sandbox if not now
                await self.link.close(kill=True)
            raise

    def _refill_pool_later(self) -> None:
        """Top the warm pool up in the background, if one is configured."""
        if self._refill_pool and (warm := self._warm_pool()) is not None:
            self._pool_refill = pool.Refill(warm, self._make_pool_member)

    async def _make_pool_member(self) -> str:
        """A new sandbox with its runner started, claimed by this kernel until it is pooled."""
        member = SandboxSession(replace(self._settings, auto_pause=pool.MEMBER_AUTO_PAUSE, warm_pool=0,
                                        name=None), client=self._client(), open_channel=False)
        try:
            await member._create()
        except BaseException:
            if member.sandbox_id:  # half made: do not leave it behind
                with contextlib.suppress(Exception):
                    await asyncio.shield(member.destroy(member.sandbox_id))
            raise
        assert member.sandbox_id is not None
        return member.sandbox_id

    async def _stop_refill(self) -> None:
        """Before the client closes: drop a pending top-up, or let a member being made finish."""
        if self._pool_refill is not None:
            await self._pool_refill.stop()

    async def attach(self, sandbox_id: str, fresh_runner: bool = False,
                     progress: Progress | None = None, ask_runner: bool = True) -> bool:
        """Drive `sandbox_id` from now on; return True if its running runner was kept.

        A runner already alive in it (a fork's, or another notebook's) is kept with its
        state, unless fresh_runner asks for a new one; even one of another bundle (another
        sandbox-kernel version, see other_version_line): its variables are the user's.
        ask_runner=False: the runner is taken to serve, unasked (see _take_member).
        """
        client = self._client()
        view = self._track(await client.get_sandbox(sandbox_id))
        if not _can_run_cells(view.status):
            raise _cannot_run_cells(view)
        previous = (self._sandbox_id, self._runner_info)
        self._sandbox_id = view.id
        ownership.use(view.id)
        ownership.drive(view.id)
        try:
            if view.status != SandboxStatus.RUNNING:
                await self._wake(progress)
            if fresh_runner:
                await self._start_runner()
                return False
            if not ask_runner:
                self._runner_info = {}
                return True
            return await self._keep_serving_runner()
        except BaseException:  # a failed attach leaves the notebook on its sandbox
            self._sandbox_id, self._runner_info = previous
            raise

    def other_version_line(self) -> str | None:
        """One line for the user if the runner this session drives was started from another
        bundle than this kernel's (an older sandbox-kernel's runner reports none), else None."""
        if not self._runner_info or runner_bundle.runs_this_bundle(self._runner_info):
            return None
        return (f"Sandbox {self._sandbox_id} runs a Python runner of another sandbox-kernel version, kept with "
                f"its variables; `%sandbox attach {self._sandbox_id} --restart-runner` starts this "
                "version's (variables and imports are lost, files are kept)")

    async def _start_runner(self, new_sandbox: bool = False) -> None:
        """Start a runner in this sandbox (runner_setup.py; an older one is stopped first,
        none in a new_sandbox) and reach it."""
        client, sandbox_id = self._require()
        with self.link.replacing_runner():  # the old runner's end is ours, not a death
            self._runner_info = await runner_setup.start_runner(client, sandbox_id, new_sandbox)
            await self.link.connect()

    @property
    def has_channel(self) -> bool:
        """Does a channel carry the runner's events (the exec fallback has none for a debugger)?"""
        return self.link.has_channel

    def egress_refusals_hint(self) -> int | None:
        """The engine's count of egress refusals as its stream last said (None: no channel).
        Only a cue to ask (channel.py); it means something only where the engine counts
        refusals at all (its egress view has denied_count: the local engine)."""
        return self.link.egress_refusals(self._sandbox_id or "")

    async def _background_event(self, event: dict[str, Any]) -> None:
        if self._on_background is not None:
            await self._on_background(event)

    def _require(self) -> tuple[SandboxClient, str]:
        if self._sandbox_id is None:
            raise SessionError("no sandbox: the session has not started")
        return self._client(), self._sandbox_id

    def _client(self) -> SandboxClient:
        if self._api is None:
            raise SessionError("no sandbox: the session has not started")
        return self._api

    # -- lifecycle ------------------------------------------------------------------------

    async def view(self) -> SandboxView:
        client, sandbox_id = self._require()
        return self._track(await client.get_sandbox(sandbox_id))

    def _track(self, view: SandboxView) -> SandboxView:
        """Remember a sandbox this notebook uses, and feed the cost meter its history."""
        if view.id not in self._known:
            self._known.append(view.id)
        if view.oom_kills is not None:
            self._oom_kills[view.id] = view.oom_kills
        self._meter.observe(view)
        return view

    async def costs(self) -> list[Cost]:
        """What every sandbox of this notebook has cost so far (on CreateOS prices)."""
        client = self._client()
        for sandbox_id in self._known:
            try:
                self._track(await client.get_sandbox(sandbox_id))
            except NotFoundError:  # CreateOS may forget a destroyed sandbox
                self._meter.note_gone(sandbox_id)
        return [self._meter.cost(sandbox_id) for sandbox_id in self._known]

    async def list_sandboxes(self) -> list[SandboxView]:
        return await self._client().list_sandboxes()

    async def get_egress(self) -> EgressView:
        client, sandbox_id = self._require()
        return await client.get_egress(sandbox_id)

    async def set_egress(self, rules: list[str]) -> EgressView:
        """Replace the sandbox's whole egress rule list ([] allows all public destinations)."""
        client, sandbox_id = self._require()
        return await client.set_egress(sandbox_id, rules)

    async def egress_destinations(self, clear: bool = False) -> EgressDestinations:
        """The destinations the sandbox asked to reach (local engine only: see
        SandboxClient.egress_destinations); `clear` starts the table afresh."""
        client, sandbox_id = self._require()
        return await client.egress_destinations(sandbox_id, clear=clear)

    async def pause(self, progress: Progress | None = None) -> SandboxView:
        client, sandbox_id = self._require()
        answer = self._settled_answer(await client.pause_sandbox(sandbox_id), SandboxStatus.PAUSED)
        return answer or await self._settle(sandbox_id, SandboxStatus.PAUSED, progress)

    async def resume(self, progress: Progress | None = None) -> SandboxView:
        """`%sandbox resume`: wake this sandbox (one running already is refused).

        Asked at once, without a look first: a sandbox that is not paused answers 409
        and changes nothing (§4.2), and is then looked at: refused if running, else waited
        for and woken as _wake does."""
        client, sandbox_id = self._require()
        try:
            answer = await client.resume_sandbox(sandbox_id)
        except ConflictError:
            return await self._wake(progress, refuse_running=True)
        view = self._settled_answer(answer, SandboxStatus.RUNNING)
        if view is None:  # resuming: it runs soon, and must not be refused for that
            return await self._wake(progress)
        await self.link.sandbox_resumed(sandbox_id)
        return view

    def _settled_answer(self, answer: SandboxView | StatusAck, target: SandboxStatus) -> SandboxView | None:
        """The view a pause, resume or fork was answered with, if it is already `target` (the
        local engine answers so once its freeze, thaw or fork is done): no poll is needed then.
        None for a transition under way, or a bare {id, status} (a full view is wanted)."""
        if isinstance(answer, SandboxView) and answer.status == target:
            return self._track(answer)
        return None

    async def _wake(self, progress: Progress | None = None, refuse_running: bool = False) -> SandboxView:
        """Bring this sandbox to running, whatever transition it is in: CreateOS answers a
        resume 409 until the sandbox is paused (§4.2), and on CreateOS an auto-pause of a
        large VM takes seconds, so a sandbox pausing, resuming or being forked is waited
        for, and a paused one resumed. One running already is left as it is (or, with
        refuse_running, refused: `%sandbox resume` of a running sandbox)."""
        client, sandbox_id = self._require()
        first = True
        async with contextlib.aclosing(self._watch(sandbox_id, progress)) as views:
            async for view in views:
                if view.status == SandboxStatus.RUNNING and first and refuse_running:
                    raise SessionError(f"sandbox {view.id} is running: there is nothing to resume")
                first = False
                if view.status == SandboxStatus.RUNNING:
                    break
                if view.status == SandboxStatus.PAUSED:
                    with contextlib.suppress(ConflictError):  # still busy: a fork of it under way
                        answer = self._settled_answer(await client.resume_sandbox(sandbox_id),
                                                      SandboxStatus.RUNNING)
                        if answer is not None:
                            view = answer
                            break
        await self.link.sandbox_resumed(sandbox_id)
        return view

    async def _fork_owned(self, sandbox_id: str, request: ForkSandboxRequest, owner: int | None) -> SandboxView:
        """The fork request, its child owned as soon as it is answered (a kernel killed later
        leaves the child to gc, not to nobody). A cancellation (Ctrl-C in a sweep) waits for the
        answer first: the local engine answers once the child is made, up to a second later,
        and a child made with nobody to record it would outlive everyone."""
        async def forked() -> SandboxView:
            child = await self._client().fork_sandbox(sandbox_id, request)
            ownership.own(child.id, owner)
            return child

        answer = asyncio.ensure_future(forked())
        try:
            return await asyncio.shield(answer)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(answer, FORK_ANSWER_WAIT)
            raise

    async def fork(self, name: str | None = None, progress: Progress | None = None,
                   on_pause: Progress | None = None, owner: int | None = None) -> SandboxView:
        """Fork this sandbox (live memory and files); return the running child, owned by
        this kernel or by the live kernel `owner` (a sweep run from the command line).

        CreateOS forks only paused sandboxes, so a running one is paused first
        (on_pause hears about it). The parent stays paused; the next cell resumes it.
        """
        client, sandbox_id = self._require()
        source = await self.view()
        try:
            envs = names.fork_envs(source, name, self._sandbox_envs(host_pip_settings.for_sandbox(self._settings)))
            if name and (holder := names.taken_by(await client.list_sandboxes(), names.checked(name))):
                raise SessionError(f"the name {name!r} is taken by sandbox {holder.id} on "
                                   f"{self._settings.description}: choose another")
        except names.SandboxNameError as exc:
            raise SessionError(str(exc)) from None
        if source.status != SandboxStatus.PAUSED:
            if on_pause:
                on_pause(f"Pausing sandbox {sandbox_id} first: only a paused sandbox can be forked")
            await self.pause(progress)
        child = await self._fork_owned(sandbox_id, ForkSandboxRequest(envs=envs), owner)
        view = (self._settled_answer(child, SandboxStatus.RUNNING)
                or await self._settle(child.id, SandboxStatus.RUNNING, progress))
        if view.auto_pause_after_seconds is None:
            view = self._track(await client.patch_sandbox(view.id, PatchSandboxRequest(
                auto_pause_after_seconds=self._settings.auto_pause or FORK_AUTO_PAUSE)))
        return view

    async def observe(self, ref: str) -> SandboxView:
        """Follow the sandbox `ref` (an id or a name) that another kernel drives, starting no
        runner and recording no use: for pausing, forking and destroying its forks (a sweep
        from the command line forks the sandbox its setup kernel made)."""
        if self._api is None:
            self._api = await open_client(self._settings)
        view = await self.find(ref)
        self._sandbox_id = view.id
        return view

    async def close(self) -> None:
        """Close the API client, and nothing else: for a session that only observed (observe),
        which owns and uses nothing."""
        if self._api is not None:
            await self._api.aclose()
            self._api = None

    async def release(self) -> None:
        """Let go of the sandbox this session drives, doing nothing to it (a branch of
        `%sandbox sweep`, whose fork the sweep destroys): the runner link and the client close."""
        self.link.begin_closing()
        await self.link.close(kill=False)
        if self._sandbox_id:
            ownership.stop_using(self._sandbox_id)
        await self.close()

    async def find(self, ref: str) -> SandboxView:
        """The sandbox an id or a name designates, from any notebook (names.py)."""
        found = names.lookup(await self.list_sandboxes(), ref)
        try:
            # Not listed (destroyed, say): its id may still answer, with its state.
            return self._track(await self._client().get_sandbox(ref)) if not found else \
                names.resolve(found, ref, self._settings.description)
        except names.SandboxNameError as exc:
            raise SessionError(str(exc)) from None
        except NotFoundError:
            raise SessionError(f"no sandbox with id or name {ref!r} on {self._settings.description}") from None

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
            delay = min(delay * POLL_GROWTH, POLL_MAX)

    # -- cells ----------------------------------------------------------------------------

    async def run_cell(self, cell_id: str, code: str, on_event: EventHandler, *,
                       silent: bool = False, store_history: bool = True,
                       execution_count: int | None = None,
                       on_resume: Callable[[], Progress] | None = None,
                       fields: dict[str, Any] | None = None, wake: bool = True,
                       on_sent: Callable[[], None] | None = None) -> dict[str, Any]:
        """Run one cell, calling on_event for every event in order; return its done event.

        fields: more of the execute_request for the runner (allow_stdin, user_expressions).

        A sandbox that is not running (CreateOS answers 409 to an exec on it) is woken
        first: paused, resumed; pausing, resuming or being forked, waited for (_wake).
        on_resume() is called then, and gives the progress callback for the wait. With
        wake False, the 409 is raised instead (ConflictError). on_sent(): as RunnerTransport.run_cell's.
        """
        kwargs = dict(silent=silent, store_history=store_history, execution_count=execution_count,
                      fields=fields or {}, on_sent=on_sent)
        try:
            return await self._run_cell(cell_id, code, on_event, **kwargs)
        except ConflictError:
            if not wake:
                raise
            view = await self.view()
            if not _can_run_cells(view.status):
                raise _cannot_run_cells(view) from None
        if view.status != SandboxStatus.RUNNING:  # (else a resume under way ended since the 409)
            progress = on_resume() if on_resume else None
            started = time.monotonic()
            await self._wake(progress)
            if progress:
                progress(f"resumed in {time.monotonic() - started:.1f} s")
        return await self._run_cell(cell_id, code, on_event, **kwargs)

    async def _run_cell(self, cell_id: str, code: str, on_event: EventHandler, *, silent: bool,
                        store_history: bool, execution_count: int | None,
                        fields: dict[str, Any], on_sent: Callable[[], None] | None) -> dict[str, Any]:
        client, sandbox_id = self._require()
        await self._runner_reachable()
        request: dict[str, Any] = {**fields, protocol.CELL_ID: cell_id, "silent": silent,
                                   "store_history": store_history,
                                   # the runner caps and paces the cell's output with these
                                   "output_limit": self._settings.output_limit,
                                   "output_rate": self._settings.output_rate}
        if execution_count is not None:
            request["execution_count"] = execution_count
        if len(code.encode()) > MAX_INLINE_CODE:
            code_file = f"{RUNNER_DIR}/{cell_id}.py"
            await client.upload_file(sandbox_id, code_file, code.encode())
            request["code_file"] = code_file
        else:
            request["code"] = code
        try:
            return await self.link.run_cell(cell_id, request, on_event, on_sent)
        except RunnerTransportError as exc:
            if exc.runner_gone:
                raise await self._runner_died(exc) from None
            raise SessionError(str(exc)) from None

    async def _runner_reachable(self) -> None:
        """Before a request: the link is up again if only its connection was lost; a runner
        that died is said (RunnerDied)."""
        try:
            await self.link.ensure_up()
        except RunnerTransportError as exc:
            raise await self._runner_died(exc) from None

    def _runner_gone(self, failure: RunnerTransportError) -> None:
        """The channel's news that the runner died, maybe between cells: the kernel hears why
        (on_runner_died) without waiting for a next cell. A sandbox that went is left to the
        next cell to say (SessionError)."""
        self._death_news = asyncio.get_running_loop().create_task(self._tell_death(failure))

    async def _tell_death(self, failure: RunnerTransportError) -> None:
        try:
            error = await self._runner_died(failure)
        except (SandboxAPIError, SessionError, OSError) as exc:  # the next request says it
            log.warning("the runner died, and why is not known: %s", exc)
            return
        if isinstance(error, RunnerDied) and self._on_runner_died is not None:
            await self._on_runner_died(error)

    async def _runner_died(self, exc: RunnerTransportError) -> SessionError:
        """Why the runner died (once per death, however many ask), as a RunnerDied for the
        kernel to say before it restarts (as a kernel whose Python dies is restarted)."""
        if self._death is None or self._death[0] is not exc:
            self._death = (exc, asyncio.ensure_future(self._why_runner_died(exc)))
        return await asyncio.shield(self._death[1])

    async def _why_runner_died(self, exc: RunnerTransportError) -> SessionError:
        """The memory limit, if the sandbox's OOM kill count went up (the local engine counts
        them), else the signal or exit code its warden recorded. With the most memory the
        Python held, if the warden recorded it, where memory may be why: killed at the limit,
        or by SIGKILL (what an OOM killer sends) where the provider counts no OOM kills
        (CreateOS). A sandbox that is gone says so instead (no runner can start there again)."""
        log.warning("the runner died: %s", exc)
        client, sandbox_id = self._require()
        seen = self._oom_kills.get(sandbox_id, 0)
        view = await self.view()
        if view.status.is_gone:
            return _sandbox_gone(view)
        end = await runner_setup.how_runner_ended(client, sandbox_id)
        if (view.oom_kills or 0) > seen:
            cause = f"killed at the memory limit of {view.mem_mib} MiB"
            if end is not None and end.peak_mib is not None:
                cause += f", its peak {end.peak_mib} MiB"
        elif end is not None:
            cause = end.cause()
            if end.killed_by(signal.SIGKILL) and view.oom_kills is None and end.peak_mib is not None:
                cause += f", its peak {end.peak_mib} MiB of the {view.mem_mib} MiB limit"
        else:
            cause = str(exc)
        return RunnerDied(f"the Python in the sandbox died ({cause}); the kernel restarts in the same "
                          "sandbox: variables and imports are gone, files are kept")

    async def runner_request(self, message: dict[str, Any]) -> dict[str, Any]:
        """One-shot runner operation with an answer (complete, inspect, info)."""
        await self._runner_reachable()
        try:
            reply = await self.link.request(message)
        except RunnerTransportError as exc:
            raise SessionError(f"the Python runner in the sandbox is not answering ({exc})") from None
        if "error" in reply:
            raise SessionError(f"the Python runner refused {message.get('op')}: {reply['error']}")
        return reply

    async def _send(self, message: dict[str, Any]) -> None:
        """A runner request without an answer (sent even while the channel's stream is down)."""
        try:
            await self.link.send(message)
        except RunnerTransportError as exc:
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
        self._meter.note_gone(sandbox_id)
        ownership.forget(sandbox_id)

    async def shutdown(self, policy: str | None = None) -> list[Kept]:
        """Close the session, applying `policy` (or on_shutdown) to every sandbox this
        kernel owns; return those kept (shutdown_policy.py)."""
        from sandbox_kernel.sandbox import shutdown_policy  # needed at the end only, not at start

        if self._api is None:
            return []
        self.link.begin_closing()
        await self._stop_refill()
        policy = policy or self._on_shutdown
        # A sandbox that outlives the kernel keeps no relay of ours (the next kernel starts its own).
        await self.link.close(kill=policy != "destroy")
        try:
            return await shutdown_policy.apply_policy(self._api, policy,
                                                      self._meter.prices, self._kept)
        finally:
            for sandbox_id in self._known:
                ownership.stop_using(sandbox_id)
            await self._api.aclose()
            self._api = None

    async def close_for_restart(self) -> list[str]:
        """A kernel restart: everything this kernel owns waits for its successor (which
        takes them over from the restart hand-off file); return those ids. Should none come
        (a kernel that died with its Python and no restarter), the shutdown policy holds:
        under `pause` or `keep` they are kept at once (running: the successor needs them so,
        and their auto-pause pauses them), under `destroy` they become orphans for `gc`."""
        owned = ownership.owned_here()
        if self._on_shutdown == "destroy":
            ownership.await_successor(owned, RESTART_HANDOFF_WAIT)
        else:
            for sandbox_id in owned:
                ownership.keep(sandbox_id)  # the successor owns them again (boot.py)
        self.link.begin_closing()
        await self._stop_refill()
        await self.link.close(kill=False)  # the successor's new runner ends it
        if self._api is not None:
            await self._api.aclose()
            self._api = None
        return owned


def _can_run_cells(status: SandboxStatus) -> bool:
    """Running, or paused or on the way there or back: the kernel wakes it, it does not give up."""
    return status == SandboxStatus.RUNNING or status.is_pause_like


def _cannot_run_cells(view: SandboxView) -> SessionError:
    return SessionError(f"sandbox {view.id} is {view.status.value}: it cannot run cells")


def _sandbox_gone(view: SandboxView) -> SessionError:
    return SessionError(f"the sandbox {view.id} is {view.status}: its Python and its files are gone; "
                        "start a new kernel for a new sandbox, or `%sandbox attach ID|NAME` another")
