"""A warm pool of ready sandboxes, so that a starting kernel does not wait for one.

With the warm_pool option at N > 0 (SANDBOX_KERNEL_WARM_POOL=N, the config file, or the
kernel argument --SandboxKernel.warm_pool=N), a kernel first tries to claim a pool member (a
sandbox created earlier, its runner already started) and then tops the pool up to N in
the background. Pools are kept per configuration key (provider, base URL, key identity,
shape, rootfs, egress rules, and the hash of the runner bundle its members were started
with): a sandbox made for one configuration, or by another sandbox-kernel version, is never
handed to another. After an upgrade the pool of the new version fills up from empty; the
old version's members wait for its kernels, or for `gc` once older than MAX_AGE.

Bookkeeping lives in the state dir, so every kernel of this user on this machine shares
one pool per key:

    state_dir/pool/<key>/lock               flock: claiming and reserving are atomic
    state_dir/pool/<key>/members/<id>.json  a ready member: {"created": unix time}
    state_dir/pool/<key>/filling/<n>.json   a member being made: {"pid": maker}

A member's record is its owner record (ownership.py) while it is pooled: claiming one
renames it into the owners folder (and pooling one, or giving one back, renames it out),
so every sandbox made here has exactly one owner record at every moment: the pool's, a
kernel's, or kept.

Only the sandbox service is used (create, exec, upload, PATCH), so the pool works the
same on CreateOS and the local engine. Waiting members carry a short auto-pause, so on
CreateOS they stop using vCPU soon; claiming one resumes it. `sandbox-kernel ls` shows
which sandboxes are pool members, and `sandbox-kernel gc` leaves fresh members alone
but destroys those older than MAX_AGE (nobody claimed them for too long).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

from sandbox_kernel.api import NotFoundError, SandboxAPIError
from sandbox_kernel.sandbox import ownership
from sandbox_kernel.sandbox.errors import SessionError
from sandbox_kernel.guest import bundle
from sandbox_kernel.config import Settings
from sandbox_kernel.paths import state_dir, write_private

log = logging.getLogger("sandbox_kernel.sandbox.pool")

# A waiting member pauses itself after this long (CreateOS allows 60 s at least).
MEMBER_AUTO_PAUSE = 120
# A member nobody claimed for this long is stale: `gc` destroys it.
MAX_AGE = 24 * 3600.0
# A kernel that claimed a member tops the pool up this long after, so that its own first
# cells do not compete for the CPU with making sandboxes for later kernels.
REFILL_DELAY = 2.0
# At shutdown, a member being made has this long to be finished and pooled.
REFILL_SHUTDOWN_WAIT = 3.0


def pool_key(settings: Settings) -> str:
    """What makes two sandboxes interchangeable, hashed (the API key only as a hash); the
    runner bundle's hash too, as a member's runner is started when it is made. Locally each
    Python environment has its own engine (local/service.py engine_dir) whose sandboxes see
    that environment: a member made by another environment's engine is not this kernel's."""
    where = settings.base_url if settings.provider == "createos" else os.path.realpath(sys.prefix)
    identity = [settings.provider, where,
                hashlib.sha256((settings.api_key or "").encode()).hexdigest(),
                settings.shape, settings.rootfs,
                sorted(settings.egress) if settings.egress is not None else None,
                settings.disk_mib,
                hashlib.sha256(json.dumps(sorted((settings.sandbox_env or {}).items())).encode()).hexdigest(),
                bundle.own_hash()]
    return hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:20]


def _pools_root(state: Path | None = None) -> Path:
    return (state or state_dir()) / "pool"


@dataclass(frozen=True)
class Member:
    """A ready sandbox of the pool, claimed: its id, and when it was made."""

    sandbox_id: str
    created: float


@dataclass(frozen=True)
class WarmPool:
    root: Path  # state_dir/pool/<key>
    size: int

    @classmethod
    def for_settings(cls, settings: Settings, size: int, state: Path | None = None) -> WarmPool:
        root = _pools_root(state) / pool_key(settings)
        for sub in ("members", "filling"):
            (root / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
        return cls(root=root, size=size)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.root / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def members(self) -> list[str]:
        """Ready members, oldest first (they are claimed in that order)."""
        entries = []
        for record in self.root.glob("members/*.json"):
            with contextlib.suppress(FileNotFoundError):  # claimed by another kernel meanwhile
                entries.append((record.stat().st_mtime, record.stem))
        return [sandbox_id for _, sandbox_id in sorted(entries)]

    def claim(self, tried: Collection[str] = ()) -> Member | None:
        """Make this kernel the owner of one ready member (never one in `tried`, never the
        same one twice), or None. Its record moves from the pool to this kernel's in one
        rename (ownership.take_from): it never has no owner, nor two."""
        with self._locked():
            for sandbox_id in self.members():
                if sandbox_id in tried:
                    continue
                record = self._member_record(sandbox_id)
                try:
                    created = float(json.loads(record.read_text())["created"])
                except (OSError, ValueError, KeyError, TypeError):
                    continue  # claimed meanwhile (or unreadable: gc's business)
                ownership.take_from(record, sandbox_id, {"created": created})
                return Member(sandbox_id, created)
        return None

    async def claim_usable(self, take: Callable[[str], Awaitable[None]],
                           destroy: Callable[[str], Awaitable[None]]) -> str | None:
        """Claim ready members in turn until `take` drives one; return its id, or None once
        none is left. A claimed member `take` fails on (destroyed behind our back, say) is
        destroyed with `destroy`, or, if even that fails, given back: never left without
        an owner."""
        tried: set[str] = set()
        while (member := self.claim(tried)) is not None:  # ours from here on (ownership.py)
            tried.add(member.sandbox_id)
            try:
                await take(member.sandbox_id)
                return member.sandbox_id
            except (SessionError, SandboxAPIError, RuntimeError) as exc:
                log.warning("warm pool sandbox %s is unusable (%s): trying another", member.sandbox_id, exc)
                await self._drop(member, destroy)
        return None

    async def _drop(self, member: Member, destroy: Callable[[str], Awaitable[None]]) -> None:
        try:
            await destroy(member.sandbox_id)
        except NotFoundError:  # gone already
            ownership.forget(member.sandbox_id)
        except (SandboxAPIError, OSError, RuntimeError) as exc:
            log.warning("could not destroy warm pool sandbox %s (%s): back to the pool", member.sandbox_id, exc)
            self.give_back(member)

    def give_back(self, member: Member) -> None:
        """A claimed member this kernel could not use, nor destroy: the pool's again (its
        record moves back in one rename), for gc to destroy once stale if nobody can use it."""
        with self._locked():
            ownership.give_to(self._member_record(member.sandbox_id), member.sandbox_id,
                              {"created": member.created})

    def _member_record(self, sandbox_id: str) -> Path:
        return self.root / "members" / f"{sandbox_id}.json"

    def _reserve(self) -> Path | None:
        """Reserve the making of one member if the pool (ready + being made) is short."""
        with self._locked():
            filling = [p for p in self.root.glob("filling/*.json") if _maker_alive(p)]
            if len(self.members()) + len(filling) >= self.size:
                return None
            ticket = self.root / "filling" / f"{uuid.uuid4().hex}.json"
            write_private(ticket, json.dumps({"pid": os.getpid()}))
            return ticket

    async def refill(self, make_member: Callable[[], Awaitable[str]]) -> int:
        """Make members until the pool is full; return how many this call made.

        make_member returns a new ready sandbox that this kernel has claimed (ownership.py).
        Other kernels may top up the same pool at the same time: reservations keep the
        total at `size`. A failure is logged and ends this refill (the next claim retries).
        """
        made = 0
        while (ticket := self._reserve()) is not None:
            try:
                sandbox_id = await make_member()
            except BaseException as exc:
                ticket.unlink(missing_ok=True)
                if not isinstance(exc, Exception):  # cancelled: the kernel is going away
                    raise
                log.warning("could not top up the warm pool: %s", exc)  # never break the kernel
                return made
            # The maker owned it while making it (so gc destroys it if the maker dies
            # half-way); pooled, it belongs to the pool until a kernel claims it.
            with self._locked():
                ownership.give_to(self._member_record(sandbox_id), sandbox_id, {"created": time.time()})
            ticket.unlink(missing_ok=True)  # only now: the pool never looks short meanwhile
            made += 1
        return made


class Refill:
    """A kernel's top-up of its warm pool, in the background: begun REFILL_DELAY after the
    kernel's start, so that its first cells have the CPU before sandboxes are made for others."""

    def __init__(self, warm: WarmPool, make_member: Callable[[], Awaitable[str]]) -> None:
        """make_member: as for WarmPool.refill. Call on the kernel's event loop."""
        self._warm = warm
        self._make_member = make_member
        self._making = False  # a member is being made: a stop lets it finish
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        await asyncio.sleep(REFILL_DELAY)
        await self._warm.refill(self._make)

    async def _make(self) -> str:
        self._making = True
        try:
            return await self._make_member()
        finally:
            self._making = False

    async def stop(self) -> None:
        """Before the kernel's client closes: drop a pending top-up, or let a member being made finish."""
        if self._task.done():
            return
        if not self._making:
            self._task.cancel()
        # Past this wait the kernel goes anyway; its half-made member stays claimed by
        # this (then dead) kernel, so `sandbox-kernel gc` destroys it.
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(asyncio.shield(self._task), REFILL_SHUTDOWN_WAIT)


def _maker_alive(ticket: Path) -> bool:
    """A reservation whose maker died is void (its half-made sandbox is gc's, see session)."""
    try:
        os.kill(int(json.loads(ticket.read_text())["pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        ticket.unlink(missing_ok=True)
        return False
    return True


def all_members(state: Path | None = None) -> dict[str, float]:
    """Every ready member of every pool on this machine: sandbox id -> creation time."""
    found = {}
    for record in _pools_root(state).glob("*/members/*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            found[record.stem] = float(json.loads(record.read_text())["created"])
    return found


def stale_members(live_ids: list[str], listed_at: float, state: Path | None = None) -> list[str]:
    """Members older than MAX_AGE, among `live_ids` (the provider's list, fetched at
    `listed_at`). Records of members missing from that list are dropped, unless they were
    made after it (a kernel may be topping up its pool right now)."""
    members = all_members(state)
    live = set(live_ids)
    for sandbox_id in set(members) - live:
        if members[sandbox_id] < listed_at:
            forget(sandbox_id, state)
    return [sandbox_id for sandbox_id, created in members.items()
            if sandbox_id in live and time.time() - created > MAX_AGE]


def forget(sandbox_id: str, state: Path | None = None) -> None:
    for record in _pools_root(state).glob(f"*/members/{sandbox_id}.json"):
        record.unlink(missing_ok=True)
