"""Freezing a local sandbox: what makes pause/resume stop every process of it.

One interface, three mechanisms, chosen once when the engine starts
(`SANDBOX_KERNEL_FREEZER=auto|cgroup-v2|cgroup-v1|signal`, default auto = the first that
really works on this host, in that order):

- cgroup v2: a child cgroup per sandbox under a writable (delegated) cgroup, frozen with
  `cgroup.freeze`; frozen once `cgroup.events` says `frozen 1`.
- cgroup v1: `/sys/fs/cgroup/freezer/sandbox-kernel/<id>`, `freezer.state` = FROZEN.
- signal: SIGSTOP to every process of the sandbox (rescanned until no new process
  appears), SIGCONT to resume. Works anywhere, but a process that the sandbox stopped
  itself is continued on resume. A sandbox's processes are bwrap's descendants by parent
  pid, and every process whose user namespace is the sandbox's or nested in it: an orphan
  (a double fork) is re-parented to the pid namespace's init, which a fork shares with its
  source, so parent links alone would lose a fork's orphans (or give them to the source).

`attach` must be called with the bwrap pid before bwrap reads its options (it blocks on
the options pipe), so every process the sandbox ever creates is inside its cgroup.
All methods block (file I/O and short polls): the engine calls them in a thread.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from select import POLLPRI, poll  # (this module's own select() chooses a freezer)

log = logging.getLogger("sandbox_kernel.freezer")

FREEZE_TIMEOUT = 10.0
EMPTY_TIMEOUT = 10.0
POLL = 0.01
POLL_FIRST = 0.0005  # a freeze usually takes well under a millisecond: look again soon
GROUP = "sandbox-kernel"
LEAF = "processes"  # cgroup v2: where a sandbox's processes live, under its own cgroup
CHOICES = ("auto", "cgroup-v2", "cgroup-v1", "signal")


class FreezerError(RuntimeError):
    pass


@dataclass
class Handle:
    """What a freezer knows about one sandbox."""

    sandbox_id: str
    pid: int  # the process everything of the sandbox descends from (bwrap)
    cgroup: Path | None = None
    more: tuple[int, ...] = ()  # further roots (e.g. the processes of a fork)
    stopped: set[int] = field(default_factory=set)
    spared: set[int] = field(default_factory=set)  # detached: no longer this sandbox's
    # signal freezer: the user namespace the sandbox's processes live in (its inode), once seen
    userns: int | None = None


class Freezer:
    name = "none"

    def describe(self) -> str:
        raise NotImplementedError

    def attach(self, sandbox_id: str, pid: int, *more: int) -> Handle:
        """Put the (not yet started) sandbox process `pid` under this freezer's control.

        `more`: further processes that belong to this sandbox with everything they start
        later (a fork's agent and runner, which are born inside the source sandbox)."""
        raise NotImplementedError

    def attach_existing(self, sandbox_id: str) -> Handle | None:
        """A handle on what an earlier engine left of this sandbox (to kill and release),
        or None if nothing of it is known here."""
        return None

    def freeze(self, handle: Handle) -> None:
        """Return once no process of the sandbox can run; raise FreezerError otherwise."""
        raise NotImplementedError

    def thaw(self, handle: Handle) -> None:
        raise NotImplementedError

    def kill(self, handle: Handle) -> None:
        """SIGKILL every process of the sandbox and make sure a frozen one can die."""
        raise NotImplementedError

    def detach(self, handle: Handle, pids: set[int]) -> None:
        """Take these processes (not their children) out of the sandbox: kill and freeze
        spare them. A destroyed sandbox's agent lives on this way while its forks need
        the pid namespace it holds."""
        raise NotImplementedError

    def release(self, handle: Handle) -> None:
        """After the sandbox's processes were killed: wait for them to go, remove the cgroup."""


# -- helpers ------------------------------------------------------------------------------


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read(path: Path) -> str:
    with open(path) as f:
        return f.read()


def _procs(cgroup: Path) -> list[int]:
    with contextlib.suppress(FileNotFoundError):
        return [int(p) for p in _read(cgroup / "cgroup.procs").split()]
    return []


def _tree(cgroup: Path) -> list[Path]:
    """The cgroup and every cgroup under it."""
    found = [cgroup]
    with contextlib.suppress(OSError):
        for entry in cgroup.iterdir():
            if entry.is_dir():
                found += _tree(entry)
    return found


def _kill(pid: int, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _remove(cgroup: Path, procs: list[int] | None = None) -> None:
    """rmdir the cgroup once its processes are gone (they may take a moment to exit), and
    first the cgroups made under it (code in a sandbox whose cgroup it may write, e.g. in
    a delegated subtree, can make some): a cgroup with children would never be empty."""
    for child in _tree(cgroup)[1:][::-1]:  # deepest first
        _remove_one(child)
    _remove_one(cgroup)


def _remove_one(cgroup: Path) -> None:
    deadline = time.monotonic() + EMPTY_TIMEOUT
    while True:
        try:
            cgroup.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                log.warning("could not remove cgroup %s: %s", cgroup, exc)
                return
        for pid in _procs(cgroup):
            _kill(pid)
        time.sleep(POLL)


def _new_cgroup(cgroup: Path, pids: tuple[int, ...]) -> Path:
    cgroup.mkdir()
    try:
        _move(cgroup, pids)
    except OSError:
        _remove(cgroup)
        raise
    return cgroup


def _move(cgroup: Path, pids: "tuple[int, ...] | set[int]") -> None:
    for pid in pids:  # moves the process (all its threads); its future children follow
        _write(cgroup / "cgroup.procs", str(pid))


def _probe(freezer: Freezer) -> None:
    """Freeze and thaw a throw-away process for real; raise if anything does not work."""
    child = subprocess.Popen(["sleep", "30"], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    handle = None
    try:
        handle = freezer.attach(f"probe-{os.getpid()}-{child.pid}", child.pid)
        freezer.freeze(handle)
        freezer.thaw(handle)
    finally:
        if handle is not None:
            freezer.kill(handle)
        child.kill()
        child.wait()
        if handle is not None:
            freezer.release(handle)


# -- cgroup v2 ----------------------------------------------------------------------------


def _cgroup2_mount() -> Path | None:
    with contextlib.suppress(OSError):
        for line in _read(Path("/proc/self/mountinfo")).splitlines():
            left, _, right = line.partition(" - ")
            if right.split(" ", 1)[0] == "cgroup2":
                return Path(left.split()[4])
    return None


def _own_cgroup2() -> str | None:
    with contextlib.suppress(OSError):
        for line in _read(Path("/proc/self/cgroup")).splitlines():
            if line.startswith("0::"):
                return line[3:].strip()
    return None


class CgroupFreezer(Freezer):
    """What both cgroup versions share: a cgroup per sandbox under `parent`."""

    parent: Path

    def attach(self, sandbox_id: str, pid: int, *more: int) -> Handle:
        self.parent.mkdir(exist_ok=True)
        return Handle(sandbox_id, pid, _new_cgroup(self.parent / sandbox_id, (pid, *more)), more)

    def attach_existing(self, sandbox_id: str) -> Handle | None:
        cgroup = self.parent / sandbox_id
        return Handle(sandbox_id, 0, cgroup) if cgroup.is_dir() else None

    def detach(self, handle: Handle, pids: set[int]) -> None:
        # Into a leaf of their own, not the parent: in v2 a cgroup whose children have
        # controllers enabled (the limits, see limits.py) may not hold processes itself.
        spared = self.parent / "spared"
        spared.mkdir(exist_ok=True)
        _move(spared, pids)

    def kill(self, handle: Handle) -> None:
        assert handle.cgroup is not None
        if (handle.cgroup / "cgroup.kill").exists():  # v2 (5.14+): the whole cgroup at once
            with contextlib.suppress(OSError):
                _write(handle.cgroup / "cgroup.kill", "1")
        for cgroup in _tree(handle.cgroup):
            for pid in _procs(cgroup):
                _kill(pid)
        # A v1-frozen task dies only once thawed; a v2 one is woken by the signal, but
        # thaw anyway so nothing waits on us.
        self.thaw(handle)

    def release(self, handle: Handle) -> None:
        assert handle.cgroup is not None
        _remove(handle.cgroup)


class CgroupV2Freezer(CgroupFreezer):
    name = "cgroup-v2"

    def __init__(self, parent: Path) -> None:
        self.parent = parent

    def describe(self) -> str:
        return f"cgroup v2 freezer ({self.parent})"

    def attach(self, sandbox_id: str, pid: int, *more: int) -> Handle:
        """The sandbox's cgroup holds its freeze and limits; its processes live in a leaf
        under it, where their cgroup namespace starts. So code in the sandbox sees (and,
        in a subtree delegated to the user it runs as, could write) only the leaf's files,
        never the limits, and cannot make a cgroup of its own: one descendant allowed."""
        self.parent.mkdir(exist_ok=True)
        cgroup = self.parent / sandbox_id
        cgroup.mkdir()
        try:
            _write(cgroup / "cgroup.max.descendants", "1")
            _new_cgroup(cgroup / LEAF, (pid, *more))
        except OSError:
            _remove(cgroup)
            raise
        return Handle(sandbox_id, pid, cgroup, more)

    @classmethod
    def candidates(cls) -> list[Path]:
        mount = _cgroup2_mount()
        if mount is None:
            return []
        found = []
        own = _own_cgroup2()
        if own is not None and own not in ("/", "") and not own.startswith("/.."):
            found.append(mount / own.lstrip("/") / GROUP)  # delegated: our own cgroup's subtree
        found.append(mount / GROUP)
        return found

    def freeze(self, handle: Handle) -> None:
        assert handle.cgroup is not None
        _write(handle.cgroup / "cgroup.freeze", "1")
        if not _await_frozen(handle.cgroup / "cgroup.events", time.monotonic() + FREEZE_TIMEOUT):
            self.thaw(handle)
            raise FreezerError("the sandbox's cgroup did not freeze in time")

    def thaw(self, handle: Handle) -> None:
        assert handle.cgroup is not None
        with contextlib.suppress(FileNotFoundError):
            _write(handle.cgroup / "cgroup.freeze", "0")


def _await_frozen(events: Path, deadline: float) -> bool:
    """Wait until `events` (a v2 cgroup.events) says `frozen 1`; False past the deadline.

    Woken by the kernel's change notification on the file (poll: POLLPRI), or by a timer
    that starts at POLL_FIRST and doubles up to POLL: a sandbox freezes in a fraction of a
    millisecond, but the kernel notifies a file at most once per 10 ms (a later change
    waits for the window's end), and a pause comes right after the thaw's notification
    often enough (a resume and a pause in a row, the source's re-freeze in a fork) that
    waiting on the notification alone made it last 10 ms (measured). No change is missed:
    poll() reports one made at any time since the file was last read."""
    with open(events, "rb", buffering=0) as file:
        poller = poll()
        poller.register(file, POLLPRI)
        wait = POLL_FIRST
        while b"frozen 1" not in file.read().splitlines():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            poller.poll(min(remaining, wait) * 1000)
            wait = min(wait * 2, POLL)
            file.seek(0)
    return True


# -- cgroup v1 ----------------------------------------------------------------------------


class CgroupV1Freezer(CgroupFreezer):
    name = "cgroup-v1"
    ROOT = Path("/sys/fs/cgroup/freezer")

    def __init__(self) -> None:
        self.parent = self.ROOT / GROUP

    def describe(self) -> str:
        return f"cgroup v1 freezer ({self.parent})"

    def attach(self, sandbox_id: str, pid: int, *more: int) -> Handle:
        if not (self.ROOT / "tasks").exists():
            raise FreezerError("no cgroup v1 freezer hierarchy mounted")
        return super().attach(sandbox_id, pid, *more)

    def freeze(self, handle: Handle) -> None:
        assert handle.cgroup is not None
        state = handle.cgroup / "freezer.state"
        _write(state, "FROZEN")
        deadline = time.monotonic() + FREEZE_TIMEOUT
        rewritten = time.monotonic()
        pause = POLL_FIRST  # v1 does not notify: look again soon, then less often
        while _read(state).strip() != "FROZEN":
            now = time.monotonic()
            if now > deadline:
                self.thaw(handle)
                raise FreezerError("the sandbox's cgroup stayed FREEZING")
            if now - rewritten > 0.5:  # FREEZING may need a nudge (tasks that were busy)
                _write(state, "FROZEN")
                rewritten = now
            time.sleep(pause)
            pause = min(pause * 2, POLL)

    def thaw(self, handle: Handle) -> None:
        assert handle.cgroup is not None
        with contextlib.suppress(FileNotFoundError):
            _write(handle.cgroup / "freezer.state", "THAWED")


# -- signals ------------------------------------------------------------------------------


def _process_table() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, state) for every process on the host."""
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = _read(Path(entry.path) / "stat")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        table[int(entry.name)] = (int(fields[1]), fields[0])
    return table


def descendants(roots: "int | tuple[int, ...]", table: dict[int, tuple[int, str]] | None = None,
                exclude: frozenset[int] = frozenset()) -> set[int]:
    """roots and every process below them, by /proc ppid links, minus the subtrees
    rooted at `exclude` (another sandbox born inside this one: a fork)."""
    table = table if table is not None else _process_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    roots = (roots,) if isinstance(roots, int) else roots
    found: set[int] = set()
    todo = [r for r in roots if r in table]
    while todo:
        pid = todo.pop()
        if pid not in found and (pid not in exclude or pid in roots):
            found.add(pid)
            todo.extend(children.get(pid, ()))
    return found


NS_GET_PARENT = 0xB702  # ioctl on a namespace fd: an fd of its parent user namespace
MAX_USERNS_DEPTH = 33  # the kernel nests user namespaces 32 deep at most


def _userns(pid: int) -> int | None:
    """The inode of pid's user namespace (None: gone, or not ours to inspect)."""
    try:
        return os.stat(f"/proc/{pid}/ns/user").st_ino
    except OSError:
        return None


def _userns_owner(pid: int, owners: dict[int, Handle], own: int) -> Handle | None:
    """The handle whose user namespace pid's is, or the nearest one it is nested in. A
    process can only ever enter user namespaces nested in its own (it has no rights in
    any other), so no process of a sandbox can leave the sandbox's this way."""
    try:
        fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        for _ in range(MAX_USERNS_DEPTH):
            inode = os.fstat(fd).st_ino
            if inode in owners:
                return owners[inode]
            if inode == own:
                return None
            try:
                parent = fcntl.ioctl(fd, NS_GET_PARENT)
            except OSError:  # the top, or a namespace outside ours
                return None
            os.close(fd)
            fd = parent
        return None
    finally:
        os.close(fd)


class SignalFreezer(Freezer):
    name = "signal"

    def __init__(self) -> None:
        self.handles: dict[str, Handle] = {}
        self.own_userns = _userns(os.getpid())

    def describe(self) -> str:
        return "SIGSTOP/SIGCONT of the sandbox's processes"

    def attach(self, sandbox_id: str, pid: int, *more: int) -> Handle:
        handle = Handle(sandbox_id, pid, more=more)
        self.handles[sandbox_id] = handle
        return handle

    def _note_userns(self, handle: Handle, table: dict[int, tuple[int, str]], others: frozenset[int]) -> None:
        """The first process down the sandbox's tree (breadth first) in a user namespace
        other than the engine's: bwrap's init for the first sandbox of a container, the
        fork's agent for a fork. Namespaces, once seen, are kept: init and the agent live
        as long as the sandbox."""
        level = [handle.pid, *handle.more]
        seen: set[int] = set()
        children: dict[int, list[int]] = {}
        for pid, (ppid, _) in table.items():
            children.setdefault(ppid, []).append(pid)
        while level and handle.userns is None:
            for pid in level:
                inode = _userns(pid)
                if inode is not None and inode != self.own_userns:
                    handle.userns = inode
                    return
            seen.update(level)
            level = [c for pid in level for c in children.get(pid, ()) if c not in seen and c not in others]

    def _tree(self, handle: Handle, table: dict[int, tuple[int, str]] | None = None) -> set[int]:
        """Every process of the sandbox now: its tree by parent pid, less the processes
        whose user namespace is another sandbox's (a fork's orphans, adopted by the
        source's init), plus every process whose user namespace is this sandbox's."""
        table = table if table is not None else _process_table()
        self.handles.setdefault(handle.sandbox_id, handle)  # one an earlier engine made
        handles = list(self.handles.values())  # (other threads attach and release)
        roots = {h.sandbox_id: frozenset((h.pid, *h.more)) for h in handles}
        for each in handles:
            if each.userns is None:
                others = frozenset().union(*(r for i, r in roots.items() if i != each.sandbox_id))
                self._note_userns(each, table, others)
        owners = {h.userns: h for h in handles if h.userns is not None}
        members: set[int] = set()
        foreign: set[int] = set()
        for pid in table:
            if _userns(pid) in (None, self.own_userns):
                continue
            owner = _userns_owner(pid, owners, self.own_userns or 0)
            if owner is handle:
                members.add(pid)
            elif owner is not None:
                foreign.add(pid)
        others = frozenset().union(*(r for i, r in roots.items() if i != handle.sandbox_id))
        tree = descendants((handle.pid, *handle.more), table, others) - foreign
        return (tree | members) - handle.spared

    def detach(self, handle: Handle, pids: set[int]) -> None:
        handle.spared |= pids

    def freeze(self, handle: Handle) -> None:
        deadline = time.monotonic() + FREEZE_TIMEOUT
        handle.stopped = set()
        while True:
            table = _process_table()
            tree = self._tree(handle, table)
            new = tree - handle.stopped
            for pid in new:
                _kill(pid, signal.SIGSTOP)
            handle.stopped |= new
            # Done when a scan finds nothing new and everything found is really stopped
            # (a process forking just before its SIGSTOP landed shows up as new next time).
            table = _process_table()
            if not (self._tree(handle, table) - handle.stopped) and all(
                    table[pid][1] in "TtZX" for pid in handle.stopped if pid in table):
                return
            if time.monotonic() > deadline:
                self.thaw(handle)
                raise FreezerError("the sandbox's processes did not all stop in time")
            time.sleep(POLL)

    def thaw(self, handle: Handle) -> None:
        for pid in self._tree(handle) | handle.stopped:
            _kill(pid, signal.SIGCONT)
        handle.stopped = set()

    def kill(self, handle: Handle) -> None:
        tree = self._tree(handle)
        for pid in tree:
            _kill(pid)
        for pid in tree:
            _kill(pid, signal.SIGCONT)
        handle.stopped = tree  # release() waits for these

    def release(self, handle: Handle) -> None:
        deadline = time.monotonic() + EMPTY_TIMEOUT
        while time.monotonic() < deadline:
            table = _process_table()
            alive = [pid for pid in handle.stopped if pid in table and table[pid][1] not in "ZX"]
            if not alive:  # (no second SIGKILL: a pid could have been reused by now)
                break
            time.sleep(POLL)
        handle.stopped = set()
        self.handles.pop(handle.sandbox_id, None)


# -- choosing -----------------------------------------------------------------------------


def _works(freezer: Freezer) -> Freezer | None:
    try:
        _probe(freezer)
        return freezer
    except Exception as exc:  # noqa: BLE001 - any failure means "not usable here"
        log.info("%s not usable: %s", freezer.describe(), exc)
        return None


def _v2() -> Freezer | None:
    for parent in CgroupV2Freezer.candidates():
        freezer = _works(CgroupV2Freezer(parent))
        if freezer:
            return freezer
    return None


def _v1() -> Freezer | None:
    return _works(CgroupV1Freezer())


def select(choice: str | None = None) -> Freezer:
    """The freezer SANDBOX_KERNEL_FREEZER asks for (default auto), checked for real here."""
    choice = (choice or os.environ.get("SANDBOX_KERNEL_FREEZER") or "auto").strip().lower()
    if choice not in CHOICES:
        raise FreezerError(f"SANDBOX_KERNEL_FREEZER={choice!r}: use one of {', '.join(CHOICES)}")
    if choice == "signal":
        return SignalFreezer()
    if choice in ("auto", "cgroup-v2"):
        freezer = _v2()
        if freezer or choice == "cgroup-v2":
            if freezer is None:
                raise FreezerError("cgroup v2 freezer is not usable here (no writable delegated cgroup)")
            return freezer
    if choice in ("auto", "cgroup-v1"):
        freezer = _v1()
        if freezer or choice == "cgroup-v1":
            if freezer is None:
                raise FreezerError("cgroup v1 freezer is not usable here "
                                   "(/sys/fs/cgroup/freezer missing or not writable)")
            return freezer
    return SignalFreezer()
