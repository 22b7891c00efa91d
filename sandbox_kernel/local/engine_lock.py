"""One engine per state dir, for its whole life: the lock it holds, and the record that
says who holds it.

An engine takes an exclusive flock on state_dir/engine.pid before it looks at anything an
earlier engine left (sandboxes to adopt, leftovers to remove), and keeps it until its
process ends. A second engine on the same dir does not start: it names the pid serving it.

The same file records the holder's pid and start time (registry.start_time), so that a
kernel tells an engine that is alive but does not answer yet (stopped, busy, adopting)
from a dead one without touching the lock: it waits for the first, and starts an engine
only in place of the second.

A flock belongs to the open file, and so to every process holding a descriptor of it.
The descriptor is close-on-exec, and the engine starts its sandboxes with close_fds: no
sandbox process holds it past its exec, so a sandbox that outlives its engine never keeps
the next engine out.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType

from sandbox_kernel.local.registry import start_time

LOCK_FILE = "engine.pid"
# A lock taken by no live recorded engine is one whose holder has just taken it (its record
# comes next) or is dying (its last threads are closing its files after its main thread,
# which /proc already shows as a zombie): a newcomer waits this long for either.
UNRECORDED_HOLDER_WAIT = 2.0


@dataclass(frozen=True)
class ServingEngine:
    """The process that serves a state dir, recognised by pid and start time (a reused pid
    has another start time)."""

    pid: int
    started: int


class EngineAlreadyServing(RuntimeError):
    """Another engine holds the state dir."""

    def __init__(self, state_dir: Path, holder: ServingEngine | None) -> None:
        who = f"pid {holder.pid}" if holder else "another process"
        super().__init__(f"the local engine of {state_dir} is already running ({who}); not starting a second one")


def serving_engine(state_dir: Path) -> ServingEngine | None:
    """The engine recorded as serving state_dir, if that process is still alive (it may be
    stopped, or not answering yet: alive all the same)."""
    try:
        data = json.loads((state_dir / LOCK_FILE).read_text())
        recorded = ServingEngine(pid=int(data["pid"]), started=int(data["started"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return recorded if start_time(recorded.pid) == recorded.started else None


class EngineLock:
    """The state dir's lock, held by this process from `take` until `release` (or its end)."""

    def __init__(self, state_dir: Path, fd: int) -> None:
        self.state_dir = state_dir
        self._fd: int | None = fd

    @classmethod
    def take(cls, state_dir: Path) -> EngineLock:
        """Hold state_dir (made if need be) for this process; EngineAlreadyServing if
        another engine does."""
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        deadline = time.monotonic() + UNRECORDED_HOLDER_WAIT
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = serving_engine(state_dir)
                if holder is not None or time.monotonic() > deadline:
                    os.close(fd)
                    raise EngineAlreadyServing(state_dir, holder) from None
                time.sleep(0.02)
        me = os.getpid()
        record = json.dumps(asdict(ServingEngine(pid=me, started=start_time(me) or 0))).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        return cls(state_dir, fd)

    def release(self) -> None:
        """Let the next engine in, its record cleared first (this process may live on). The
        file stays: removing it would let a newcomer lock a new file while a third process
        still held the old one."""
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> EngineLock:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.release()

