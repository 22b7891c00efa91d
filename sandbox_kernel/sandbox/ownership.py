"""Who is responsible for each sandbox a kernel on this machine made, so that nothing a
notebook made outlives it silently and `sandbox-kernel gc` finds what a dead kernel left.

One 0600 record per sandbox, state_dir/owners/<sandbox id>.json:
  owner          pid of the kernel that owns it (created it, forked it, took it from the
                 warm pool or was handed it): its shutdown policy applies to it; null once kept
  kept           the user handed it off (`%sandbox keep`, or an on-shutdown policy of pause
                 or keep): no kernel's business any more, never an orphan
  users          pids of the kernels driving it (attach); an owner shutting down hands a
                 sandbox another live kernel drives over to that kernel instead of destroying it
  handoff_until  a restarting kernel's sandboxes wait this long for its successor
A sandbox being created has no id yet: state_dir/owners/creating-<name>.json names it
(kernels create with a name), so a kernel that dies or shuts down mid-create still leaves
a trace `gc` follows. A warm pool member's record lives in its pool (pool.py) and moves
here, in one rename, when a kernel claims it: every sandbox made here has exactly one
record at every moment. Sandboxes nobody on this machine recorded are never touched.
Every read-modify-write holds an flock on state_dir/owners/.lock (several kernels share it).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sandbox_kernel.paths import state_dir, write_private

KERNEL_MARKER = b"sandbox_kernel.kernel"  # in the command line of every sandbox kernel
CREATING = "creating-"
# A create whose kernel died and whose sandbox never appeared is forgotten after this long
# (a create in flight may still finish on the provider: CreateOS creates can take minutes).
CREATE_TRACE_MAX_AGE = 3600.0


@dataclass
class Record:
    owner: int | None = None
    kept: bool = False
    users: list[int] = field(default_factory=list)
    handoff_until: float = 0.0


def _folder() -> Path:
    path = state_dir() / "owners"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _locked() -> Iterator[Path]:
    folder = _folder()
    with open(folder / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield folder


def _read(folder: Path, sandbox_id: str) -> Record | None:
    try:
        data = json.loads((folder / f"{sandbox_id}.json").read_text())
        return Record(owner=data.get("owner"), kept=bool(data.get("kept")),
                      users=[int(pid) for pid in data.get("users", [])],
                      handoff_until=float(data.get("handoff_until", 0.0)))
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def _write(folder: Path, sandbox_id: str, record: Record) -> None:
    write_private(folder / f"{sandbox_id}.json", json.dumps(asdict(record)))


def _records(folder: Path) -> dict[str, Record]:
    found = {}
    for path in folder.glob("*.json"):
        if not path.name.startswith(CREATING) and (record := _read(folder, path.stem)) is not None:
            found[path.stem] = record
    return found


def kernel_alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        return KERNEL_MARKER in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


# -- what a kernel records ---------------------------------------------------------------

def _update(sandbox_id: str, change: Callable[[Record], None]) -> None:
    """Apply `change` to the sandbox's record (a new one if it has none), under the lock."""
    with _locked() as folder:
        record = _read(folder, sandbox_id) or Record()
        change(record)
        _write(folder, sandbox_id, record)


def own(sandbox_id: str, owner: int | None = None) -> None:
    """This kernel is now responsible for the sandbox (and drives it or may); or the live
    kernel `owner` is, which does not drive it (yet)."""
    me = owner or os.getpid()

    def take(record: Record) -> None:
        record.owner, record.kept, record.handoff_until = me, False, 0.0
        if owner is None:
            record.users = [*(pid for pid in record.users if pid != me), me]
    _update(sandbox_id, take)


def use(sandbox_id: str) -> None:
    """This kernel drives a sandbox it does not own (attach): its owner stays responsible."""
    me = os.getpid()
    _update(sandbox_id, lambda record: record.users.append(me) if me not in record.users else None)


def stop_using(sandbox_id: str) -> None:
    me = os.getpid()
    _update(sandbox_id, lambda record: setattr(record, "users", [pid for pid in record.users if pid != me]))


def owns(sandbox_id: str) -> bool:
    with _locked() as folder:
        record = _read(folder, sandbox_id)
    return record is not None and record.owner == os.getpid()


def is_kept(sandbox_id: str) -> bool:
    """Whether the user handed the sandbox off (keep): it outlives every notebook."""
    with _locked() as folder:
        record = _read(folder, sandbox_id)
    return record is not None and record.kept


def owned_here() -> list[str]:
    """The sandboxes this kernel owns."""
    me = os.getpid()
    with _locked() as folder:
        return sorted(sandbox_id for sandbox_id, record in _records(folder).items() if record.owner == me)


def keep(sandbox_id: str) -> None:
    """The user hands the sandbox off: no kernel destroys it, `gc` leaves it alone."""

    def hand_off(record: Record) -> None:
        record.owner, record.kept, record.handoff_until = None, True, 0.0
    _update(sandbox_id, hand_off)


def driven_elsewhere(sandbox_id: str) -> int | None:
    """The pid of another live kernel that drives the sandbox, if any."""
    me = os.getpid()
    with _locked() as folder:
        record = _read(folder, sandbox_id)
    users = record.users if record is not None else []
    return next((pid for pid in users if pid != me and kernel_alive(pid)), None)


def hand_over(sandbox_id: str, heir: int) -> None:
    """Make another live kernel that drives the sandbox its owner."""
    me = os.getpid()

    def bequeath(record: Record) -> None:
        record.owner, record.users = heir, [pid for pid in record.users if pid != me]
    _update(sandbox_id, bequeath)


def await_successor(sandbox_ids: list[str], seconds: float) -> None:
    """A restart: these stay this (exiting) kernel's until its successor owns them, or
    `seconds` pass without one (then they are orphans)."""
    until = time.time() + seconds
    for sandbox_id in sandbox_ids:
        _update(sandbox_id, lambda record: setattr(record, "handoff_until", until))


def forget(sandbox_id: str, name: str | None = None) -> None:
    """The sandbox is gone (destroyed)."""
    with _locked() as folder:
        (folder / f"{sandbox_id}.json").unlink(missing_ok=True)
        if name:
            (folder / f"{CREATING}{name}.json").unlink(missing_ok=True)


# -- moving a record between this folder and another owner's (the warm pool's) ------------

def take_from(record: Path, sandbox_id: str, carried: dict[str, object]) -> None:
    """This kernel becomes the owner of a sandbox whose one record is `record`, outside this
    folder (a warm pool member's): the record is rewritten as ours, then renamed in. A
    rename is atomic, so at every moment the sandbox has exactly one record, there or here,
    even if this kernel dies half-way (then gc finds it, either way). `carried`: the other
    owner's fields, kept in the file so that its readers still understand it until the
    rename. The caller holds the lock guarding `record`."""
    me = os.getpid()
    with _locked() as folder:
        write_private(record, json.dumps({**carried, **asdict(Record(owner=me, users=[me]))}))
        os.rename(record, folder / f"{sandbox_id}.json")


def give_to(record: Path, sandbox_id: str, carried: dict[str, object]) -> None:
    """The reverse of take_from: the sandbox's record here becomes `record` outside (a warm
    pool member's), with the other owner's fields `carried`. The caller holds the lock
    guarding `record`."""
    with _locked() as folder:
        ours = folder / f"{sandbox_id}.json"
        try:
            current = json.loads(ours.read_text())
        except (OSError, ValueError):  # never recorded here
            write_private(record, json.dumps(carried))
            return
        write_private(ours, json.dumps({**current, **carried}))
        os.rename(ours, record)


# -- sandboxes being created ---------------------------------------------------------------

def creating(name: str) -> None:
    """This kernel is about to create a sandbox called `name`."""
    with _locked() as folder:
        write_private(folder / f"{CREATING}{name}.json",
                      json.dumps({"owner": os.getpid(), "since": time.time()}))


def created(name: str, sandbox_id: str | None) -> None:
    """The create of `name` returned (sandbox_id, owned from now on) or surely failed (None)."""
    if sandbox_id is not None:
        own(sandbox_id)
    with _locked() as folder:
        (folder / f"{CREATING}{name}.json").unlink(missing_ok=True)


def creating_here() -> list[str]:
    """Names of sandboxes this kernel started creating and has no id for yet."""
    me = os.getpid()
    return [name for name, (owner, _) in _creates().items() if owner == me]


def _creates() -> dict[str, tuple[int | None, float]]:
    """name -> (pid of the creating kernel, when it began)."""
    with _locked() as folder:
        creates = {}
        for path in folder.glob(f"{CREATING}*.json"):
            with contextlib.suppress(OSError, ValueError, AttributeError):
                data = json.loads(path.read_text())
                creates[path.stem[len(CREATING):]] = (data.get("owner"), float(data.get("since", 0)))
        return creates


# -- what `gc` and `ls` read ---------------------------------------------------------------

def orphaned(live: dict[str, str | None]) -> list[str]:
    """Those of the live sandboxes (id -> name) whose owning kernel on this machine is gone:
    recorded with a dead owner, or created under a name by a kernel that died before it
    learnt the id. A sandbox another live kernel still drives is not an orphan."""
    now = time.time()
    with _locked() as folder:
        records = _records(folder)
    dead_creates = {name for name, (owner, _) in _creates().items() if not kernel_alive(owner)}
    found = []
    for sandbox_id, name in live.items():
        record = records.get(sandbox_id)
        if record is None:
            if name in dead_creates:
                found.append(sandbox_id)
        elif (not record.kept and record.owner is not None and not kernel_alive(record.owner)
              and record.handoff_until < now and not any(kernel_alive(pid) for pid in record.users)):
            found.append(sandbox_id)
    return found


def tidy(live: dict[str, str | None]) -> None:
    """Drop the records of sandboxes that no longer exist, and creates of dead kernels
    that never produced a sandbox."""
    names = set(live.values())
    stale = [name for name, (owner, since) in _creates().items()
             if not kernel_alive(owner) and name not in names and time.time() - since > CREATE_TRACE_MAX_AGE]
    with _locked() as folder:
        for sandbox_id in _records(folder):
            if sandbox_id not in live:
                (folder / f"{sandbox_id}.json").unlink(missing_ok=True)
        for name in stale:
            (folder / f"{CREATING}{name}.json").unlink(missing_ok=True)
    for driving in _driving_folder().iterdir():
        if not (driving.name.isdigit() and kernel_alive(int(driving.name))):
            driving.unlink(missing_ok=True)


@dataclass(frozen=True)
class Owner:
    """Who is responsible for a sandbox: kind is kernel (pid: a live kernel), kept (the
    user), restarting (a kernel's successor is awaited), orphaned (its kernel is gone: gc
    destroys it) or none (nobody on this machine)."""

    kind: str
    pid: int | None = None

    def __str__(self) -> str:
        return {"kernel": f"kernel {self.pid}", "kept": "kept", "restarting": "restarting kernel",
                "orphaned": "gone (gc)"}.get(self.kind, "-")


def owner_of(sandbox_id: str, name: str | None) -> Owner:
    with _locked() as folder:
        record = _read(folder, sandbox_id)
    if record is None:
        owner, _ = _creates().get(name or "", (None, 0.0))
        return Owner("kernel", owner) if kernel_alive(owner) else Owner("orphaned" if owner else "none")
    if record.kept:
        return Owner("kept")
    if record.owner is None:  # only driven (attached to) from here: nobody's to clean up
        return Owner("none")
    if kernel_alive(record.owner):
        return Owner("kernel", record.owner)
    if record.handoff_until >= time.time():
        return Owner("restarting")
    return Owner("orphaned")


def describe_owner(sandbox_id: str, name: str | None) -> str:
    """Who is responsible for a sandbox, for `ls`: a kernel, the user (kept), or nobody here."""
    return str(owner_of(sandbox_id, name))


# -- which sandbox each kernel drives now (the Sandboxes panel's "this notebook") -----------

def _driving_folder() -> Path:
    path = state_dir() / "driving"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def drive(sandbox_id: str) -> None:
    """This kernel's cells run in `sandbox_id` from now on (one file per kernel pid)."""
    write_private(_driving_folder() / str(os.getpid()), sandbox_id)


def driven_by(pid: int) -> str | None:
    """The sandbox the live kernel `pid` drives, if it recorded one."""
    if not kernel_alive(pid):
        return None
    try:
        return (_driving_folder() / str(pid)).read_text().strip() or None
    except OSError:
        return None
