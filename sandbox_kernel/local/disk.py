"""The shape's disk size as a real cap on a local sandbox's /workspace and /tmp.

When the engine runs as root with loop devices and mkfs.ext4, each sandbox gets a sparse
ext4 image of its disk size in its state directory, loop-mounted (nosuid, nodev) where
its /workspace and /tmp live, in a mount namespace of its own (see `mounted`). Writing
past the size fails with ENOSPC inside the sandbox; the host's disk holds only what was
really written. A tmpfs would cap the size
too, but its pages count as memory: with a disk larger than the memory limit (every
shape) filling it would OOM-kill the sandbox instead of ENOSPC. Without root the size is
not capped, and `sandbox-kernel doctor` says so.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

TOOLS = ("mkfs.ext4", "mount", "unshare")
MOUNT_OPTIONS = "loop,nosuid,nodev,noatime,noinit_itable"  # loop: detached when unmounted
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


def create(image: Path, contents: Path, size_mib: int) -> None:
    """A fresh ext4 image of size_mib holding a copy of the directory `contents` (the
    sandbox's empty workspace and tmp, with their modes). Blocking: call in a thread."""
    with open(image, "wb") as out:
        out.truncate(size_mib * 1024 * 1024)  # sparse: costs the host nothing yet
    # Lazy init: no zeroing of inode tables or journal now (it would write the whole size);
    # no reserved blocks: the sandbox may use all of it.
    _run("mkfs.ext4", "-q", "-F", "-m", "0", "-E", "lazy_itable_init=1,lazy_journal_init=1",
         "-d", str(contents), str(image))


def mounted(command: list[str], image: Path, mount_point: Path) -> list[str]:
    """`command` started in a private mount namespace in which the image is mounted at
    mount_point. The mount exists only there: it goes, and its loop device with it, when
    the sandbox's last process does, however the engine ends (no host mount to leak)."""
    unshare, mount, shell = _tool("unshare"), _tool("mount"), _tool("sh")
    if unshare is None or mount is None or shell is None:
        raise OSError("unshare, mount or sh not found")
    script = '"$1" -o "$2" "$3" "$4" && shift 4 && exec "$@"'  # exec: bwrap keeps this pid
    return [unshare, "--mount", "--propagation", "private", shell, "-c", script, "mount-volume",
            mount, MOUNT_OPTIONS, str(image), str(mount_point), *command]
