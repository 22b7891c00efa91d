"""The shape's disk size as a real cap on a local sandbox's /workspace and /tmp.

When the engine runs as root with loop devices and mkfs.ext4, each sandbox gets a sparse
ext4 image of its disk size in its state directory, loop-mounted (nosuid, nodev) where
its /workspace and /tmp live. Writing past the size fails with ENOSPC inside the
sandbox; the host's disk holds only what was really written. A tmpfs would cap the size
too, but its pages count as memory: with a disk larger than the memory limit (every
shape) filling it would OOM-kill the sandbox instead of ENOSPC. Without root the size is
not capped, and `sandbox-kernel doctor` says so.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

log = logging.getLogger("sandbox_kernel.disk")

TOOLS = ("mkfs.ext4", "mount", "umount")
TIMEOUT = 60


def _tool(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def available() -> bool:
    """Can this engine make capped volumes? (root, loop devices, the tools)"""
    return (os.geteuid() == 0 and Path("/dev/loop-control").exists()
            and all(_tool(name) for name in TOOLS))


def _run(*command: str) -> None:
    tool = _tool(command[0])
    if tool is None:
        raise OSError(f"{command[0]} not found")
    result = subprocess.run([tool, *command[1:]], capture_output=True, text=True, timeout=TIMEOUT)
    if result.returncode != 0:
        raise OSError(f"{command[0]} failed: {result.stderr.strip()[-300:]}")


def create(image: Path, mount_point: Path, size_mib: int) -> None:
    """A fresh ext4 volume of size_mib mounted at mount_point (blocking: call in a thread)."""
    with open(image, "wb") as out:
        out.truncate(size_mib * 1024 * 1024)  # sparse: costs the host nothing yet
    # Lazy init: no zeroing of inode tables or journal now (it would write the whole size);
    # no reserved blocks: the sandbox may use all of it.
    _run("mkfs.ext4", "-q", "-F", "-m", "0", "-E",
         f"lazy_itable_init=1,lazy_journal_init=1,root_owner={os.getuid()}:{os.getgid()}", str(image))
    mount_point.mkdir(mode=0o700, exist_ok=True)
    _run("mount", "-o", "loop,nosuid,nodev,noatime,noinit_itable", str(image), str(mount_point))


def is_mounted(mount_point: Path) -> bool:
    target = str(mount_point)
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as info:
        return any(line.split()[4] == target for line in info)
    return False


def remove(mount_point: Path) -> None:
    """Unmount (lazily, if something still holds it; the loop device then goes with it)."""
    if is_mounted(mount_point):
        try:
            _run("umount", str(mount_point))
        except OSError:
            with contextlib.suppress(OSError):
                _run("umount", "-l", str(mount_point))
