"""Which host user a local sandbox's processes run as.

Inside, every sandbox runs as uid/gid 1000 of its own user namespace; bwrap maps that to
the uid of whoever starts bwrap. An engine run by a normal user starts bwrap as itself:
sandboxes are that user, without its capabilities. An engine run as root must not do
the same (its sandboxes would be host uid 0: able to write root-owned sysctls and read
0600 root files in every tree they see), so it starts each sandbox's bwrap as a host
uid/gid of its own, from a range no account uses (no passwd entry needed), with no
supplementary groups (unprivileged_launch.py). bwrap then runs unprivileged and maps
1000 onto that uid. What needs root (cgroups, the disk volume) the engine does before
the drop.
"""

from __future__ import annotations

import os
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path

# 2^30 + 2^24 ids: above every distribution's account and subordinate-id ranges
# (/etc/subuid starts at 100000 and grows by 65536 per user), below 2^31.
FIRST_ID = 1 << 30
ID_COUNT = 1 << 24


LAUNCHER = Path(__file__).with_name("unprivileged_launch.py")


class HostUserError(RuntimeError):
    pass


@dataclass(frozen=True)
class HostUser:
    """The host uid and gid one sandbox runs as (uid == gid)."""

    uid: int

    @property
    def gid(self) -> int:
        return self.uid

    def give(self, *paths: Path) -> None:
        """Make these (engine-made) directories the sandbox's."""
        for path in paths:
            os.chown(path, self.uid, self.gid)

    def launcher(self, stage: str, sources: list[str], command: list[str]) -> list[str]:
        """`command` (bwrap) started as this user by unprivileged_launch.py, with `sources`
        bound at stage/<n> for it; file descriptors pass through unchanged."""
        return [sys.executable, "-I", "-S", str(LAUNCHER), str(self.uid), str(self.gid),
                stage, *sources, "--", *command]


def needs_own_user() -> bool:
    """Does this engine give each sandbox a host user of its own? (only when run as root)"""
    return os.geteuid() == 0


def allocate(taken: set[int]) -> HostUser:
    """A fresh host user for one sandbox: random in the range, not one a live sandbox of
    this engine has, nor one any process on the host runs as."""
    in_use = taken | _uids_of_running_processes()
    for _ in range(100):
        uid = FIRST_ID + secrets.randbelow(ID_COUNT)
        if uid not in in_use:
            return HostUser(uid)
    raise HostUserError("no free host uid for a sandbox")


def _uids_of_running_processes() -> set[int]:
    found = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                found.add(entry.stat().st_uid)
            except OSError:
                continue
    return found
