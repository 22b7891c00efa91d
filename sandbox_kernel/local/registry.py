"""What the local engine persists about each sandbox, so that an engine that stopped,
crashed or was upgraded leaves its sandboxes running (or paused) and the next engine on
the same state dir takes them over: same ids, state, egress rules, limits, auto-pause.

One 0600 file per sandbox, state_dir/sandboxes/<id>/record.json, rewritten (atomically)
whenever the sandbox changes state. The processes themselves are no engine's children
(bwrap runs without --die-with-parent), so they outlive the engine; a record is trusted
only while its bwrap process still runs, recognised by pid and start time (a reused pid
has another start time).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from pathlib import Path
from typing import Any

from sandbox_kernel.paths import write_private

RECORD = "record.json"


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after the command name, which may hold spaces
    return None if fields[0] == "Z" else int(fields[19])


class AdoptedProcess:
    """A sandbox's bwrap process that an earlier engine started: not our child, so it is
    watched through a pidfd instead of waitpid. Same surface as asyncio's Process where
    the engine uses it (pid, returncode, kill, wait)."""

    def __init__(self, pid: int, started: int) -> None:
        self.pid = pid
        self.started = started

    @property
    def returncode(self) -> int | None:
        return None if start_time(self.pid) == self.started else -signal.SIGKILL

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    async def wait(self) -> int:
        try:
            pidfd = os.pidfd_open(self.pid)
        except OSError:  # gone already
            return -signal.SIGKILL
        exited = asyncio.get_running_loop().create_future()
        loop = asyncio.get_running_loop()
        loop.add_reader(pidfd, lambda: exited.done() or exited.set_result(None))
        try:
            if self.returncode is None:  # not gone between the check and the pidfd
                await exited
        finally:
            loop.remove_reader(pidfd)
            os.close(pidfd)
        return -signal.SIGKILL


def save(root: Path, record: dict[str, Any]) -> None:
    if root.is_dir():  # never recreate the directory of a sandbox being removed
        write_private(root / RECORD, json.dumps(record))


def load(sandbox_root: Path) -> list[dict[str, Any]]:
    """The records of this state dir whose bwrap process still runs."""
    found = []
    for entry in os.scandir(sandbox_root):
        with contextlib.suppress(OSError, ValueError, KeyError):
            record = json.loads(Path(entry.path, RECORD).read_text())
            family = record["family"]
            if start_time(family["bwrap_pid"]) == family["bwrap_started"]:
                found.append(record)
    return found
