"""Start bwrap as a sandbox's own unprivileged host user, from an engine run as root.

Run as a script by the engine (stdlib only, `python -I -S`; see hostuser.py for why):

    unprivileged_launch.py UID GID STAGE SOURCE... -- BWRAP ARG...

bwrap, once unprivileged, must still reach every host path it binds into the sandbox,
but the engine's Python environment or state dir may sit under a directory only root
may enter (/root is 0700). So, as root, in a mount namespace of its own (nothing here
touches the host's mounts): open every SOURCE, cover STAGE with a fresh tmpfs that
anyone may traverse, and bind SOURCE number i at STAGE/i (the engine wrote bwrap's
options with those paths). Then drop to UID/GID with no supplementary groups and no
capabilities, and exec bwrap; BWRAP may itself be a path under STAGE.
"""

from __future__ import annotations

import ctypes
import os
import sys

CLONE_NEWNS = 0x00020000
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MS_NOSUID, MS_NODEV = 2, 4

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        error = ctypes.get_errno()
        raise OSError(error, "%s: %s" % (what, os.strerror(error)))


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(_libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(),
                       ctypes.c_ulong(flags), data and data.encode()), "mount " + target)


def stage(stage_dir: str, sources: list[str]) -> None:
    _check(_libc.unshare(CLONE_NEWNS), "unshare")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    # Opened in this namespace (a bind from another one fails), before STAGE is covered.
    fds = [os.open(source, os.O_PATH | os.O_CLOEXEC) for source in sources]
    _mount("tmpfs", stage_dir, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    for number, fd in enumerate(fds):
        target = os.path.join(stage_dir, str(number))
        if os.path.isdir("/proc/self/fd/%d" % fd):
            os.mkdir(target)
        else:
            open(target, "x").close()
        _mount("/proc/self/fd/%d" % fd, target, None, MS_BIND | MS_REC)
        os.close(fd)


def drop(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)  # from root to another uid: every capability goes too


def main(argv: list[str]) -> int:
    try:
        split = argv.index("--")
        uid, gid, stage_dir, *sources = argv[1:split]
        command = argv[split + 1:]
        stage(stage_dir, sources)
        drop(int(uid), int(gid))
        os.execv(command[0], command)
    except (OSError, ValueError) as exc:
        sys.stderr.write("sandbox launch failed: %s\n" % exc)
    return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv))
