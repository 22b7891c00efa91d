"""Turn a process forked inside a sandbox into the first process of a NEW sandbox.

Runs inside the source sandbox (stdlib only, no privilege: everything happens in a user
namespace the process creates for itself). After `become_sandbox()` the process has:

- fresh user, mount, network, uts and ipc namespaces (the pid namespace stays shared with
  its relatives: a pid namespace cannot be left, and destroying the source must not take
  the fork down, so the engine keeps the family's namespace alive instead);
- a new root (tmpfs) holding a COPY of the source's /workspace and /tmp, read-only binds
  of everything else the source saw (/usr, the Python environment, /etc, /opt...), a
  fresh /dev/shm and /dev/pts, and nothing of the source's writable places;
- the old root detached, so nothing of the source sandbox stays reachable through it.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import shutil
import socket
import stat
import struct

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND = 32, 1024, 2048, 4096
MS_REC, MS_PRIVATE, MS_RELATIME = 16384, 1 << 18, 1 << 21
MNT_DETACH = 2
PR_SET_DUMPABLE = 4
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
# statvfs f_flag bits -> the mount flags a remount must keep (locked flags cannot be dropped)
KEPT_FLAGS = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
              (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME),
              (os.ST_RELATIME, MS_RELATIME))
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "armv7l": 218, "ppc64le": 203, "s390x": 217,
              "riscv64": 41}

# Places whose contents are the sandbox's own data: copied, never shared.
COPIED = ("workspace", "tmp")
STAGING = "/run"  # a fresh tmpfs goes over it; the new root is built inside

_libc = ctypes.CDLL(None, use_errno=True)


class ForkSetupError(Exception):
    pass


def _check(result: int, what: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise ForkSetupError("%s: %s" % (what, os.strerror(code)))


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(_libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(),
                       ctypes.c_ulong(flags), data and data.encode()), "mount %s" % target)


def _write(path: str, text: str) -> None:
    with open(path, "w") as out:
        out.write(text)


def _set_dumpable(dumpable: bool) -> None:
    _check(_libc.prctl(PR_SET_DUMPABLE, int(dumpable), 0, 0, 0), "prctl(PR_SET_DUMPABLE)")


def _enter_namespaces() -> None:
    uid, gid = os.getuid(), os.getgid()
    _check(_libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWUTS | CLONE_NEWIPC),
           "unshare")
    # Keep the same ids inside; setgroups must be denied before an unprivileged gid_map.
    # The process (a copy of the undumpable agent) must be dumpable to write these files
    # of its own: only for as long as that takes, since a dumpable process is open to
    # the code of the sandbox (its memory, its descriptors: the new agent's listener).
    _set_dumpable(True)
    try:
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", "%d %d 1\n" % (uid, uid))
        _write("/proc/self/gid_map", "%d %d 1\n" % (gid, gid))
    finally:
        _set_dumpable(False)
    # Nothing mounted from here on may propagate back into the source sandbox.
    _mount(None, "/", None, MS_REC | MS_PRIVATE)


def _loopback_up() -> None:
    """A new network namespace starts with `lo` down; bring it up, as bwrap does."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH14s", b"lo", 0, b"")
        flags = struct.unpack("16sH14s", fcntl.ioctl(sock, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sH14s", b"lo", flags | IFF_UP, b""))


def _bind_read_only(source: str, target: str) -> None:
    """Recursive bind (locked child mounts only move as a whole), then read-only on top."""
    _mount(source, target, None, MS_BIND | MS_REC)
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY
    current = os.statvfs(target).f_flag
    for st_flag, ms_flag in KEPT_FLAGS:
        if current & st_flag:
            flags |= ms_flag
    _mount(None, target, None, flags)


def _mount_points_under(prefix: str) -> list[str]:
    with open("/proc/self/mountinfo") as info:
        points = [line.split()[4] for line in info]
    return sorted(p for p in points if p.startswith(prefix + "/"))


def _copy_tree(source: str, target: str) -> None:
    """Copy a writable place, without descending into mounts under it (rebound later)."""
    mounts = set(_mount_points_under(source))

    def ignore(directory: str, names: list[str]) -> list[str]:
        skipped = []
        for name in names:
            path = os.path.join(directory, name)
            if path in mounts:
                skipped.append(name)
                continue
            try:
                mode = os.lstat(path).st_mode
            except OSError:
                skipped.append(name)
                continue
            if stat.S_ISSOCK(mode) or stat.S_ISFIFO(mode):
                skipped.append(name)  # endpoints of the source's processes, meaningless here
        return skipped

    shutil.copytree(source, target, symlinks=True, ignore=ignore, dirs_exist_ok=True)
    shutil.copystat(source, target)
    for mount in mounts:
        # e.g. a read-only Python environment the engine mounted under /tmp
        inner = target + mount[len(source):]
        os.makedirs(inner, exist_ok=True) if os.path.isdir(mount) else open(inner, "a").close()
        _bind_read_only(mount, inner)


def _build_root(new_root: str, agent_dir: str) -> None:
    for name in sorted(os.listdir("/")):
        source, target = "/" + name, os.path.join(new_root, name)
        if os.path.islink(source):
            os.symlink(os.readlink(source), target)
        elif name in COPIED:
            os.mkdir(target)
            _copy_tree(source, target)
        elif name == STAGING.strip("/"):
            os.makedirs(os.path.join(target, agent_dir.strip("/")[len(name) + 1:]), mode=0o700)
        elif name == "proc":
            os.mkdir(target)
            _mount(source, target, None, MS_BIND | MS_REC)
        elif os.path.isdir(source):
            os.mkdir(target)
            _bind_read_only(source, target)
    # Private /dev/shm and /dev/pts: the source's would be shared with it. /dev/shm is as
    # big as the source's (the engine sized that to the shape's memory): an unsized tmpfs
    # could take half the host's memory, which no rlimit counts.
    dev = os.path.join(new_root, "dev")
    shm = os.statvfs("/dev/shm")
    _mount("tmpfs", os.path.join(dev, "shm"), "tmpfs", MS_NOSUID | MS_NODEV,
           "size=%d,mode=1777" % (shm.f_blocks * shm.f_frsize))
    _mount("devpts", os.path.join(dev, "pts"), "devpts", MS_NOSUID | MS_NOEXEC,
           "newinstance,ptmxmode=0666,mode=620")


def _pivot(new_root: str) -> None:
    machine = os.uname().machine  # (platform.machine(), without importing platform)
    number = PIVOT_ROOT.get(machine)
    if number is None:
        raise ForkSetupError("pivot_root: unknown architecture %s" % machine)
    old = os.path.join(new_root, ".old-root")
    os.mkdir(old)
    _check(_libc.syscall(number, new_root.encode(), old.encode()), "pivot_root")
    os.chdir("/")
    _check(_libc.umount2(b"/.old-root", MNT_DETACH), "umount old root")
    os.rmdir("/.old-root")


def become_sandbox(hostname: str, disk_mib: int, agent_dir: str, workdir: str) -> None:
    """Make the calling (single-threaded, freshly forked) process a new sandbox's first process."""
    _enter_namespaces()
    _loopback_up()
    _mount("tmpfs", STAGING, "tmpfs", MS_NOSUID | MS_NODEV, "size=%dm,mode=755" % disk_mib)
    new_root = os.path.join(STAGING, "root")
    os.mkdir(new_root)
    _mount("tmpfs", new_root, "tmpfs", MS_NOSUID | MS_NODEV, "size=%dm,mode=755" % disk_mib)
    _build_root(new_root, agent_dir)
    _pivot(new_root)
    name = hostname.encode()
    _check(_libc.sethostname(name, len(name)), "sethostname")
    # Empty and read-only, as in the first sandbox of a family: the agent serves a socket
    # the engine bound on the host, and nothing here can be put in its place.
    _bind_read_only(agent_dir, agent_dir)
    try:
        os.chdir(workdir)
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            raise

