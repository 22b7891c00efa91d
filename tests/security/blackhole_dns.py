"""Run a command (a local engine) whose name lookups hang until the test says otherwise.

    python blackhole_dns.py CONTROL_DIR -- COMMAND...

The command runs in a network and mount namespace of its own (and, for a normal user, a
user namespace mapping only its own uid, so it keeps being that normal user): there
/etc/resolv.conf names a resolver on the namespace's loopback, asked over TCP
(`use-vc`), and this script's child serves that port by accepting every connection and
never answering. glibc reads a TCP answer with no timeout, so each getaddrinfo() the
command makes blocks in its thread until the connection closes: the real resolver code
path, hung for as long as the test wants. Nothing outside the new namespaces is touched.

CONTROL_DIR/held: how many lookups are held now (rewritten on every change);
create CONTROL_DIR/release to close them all and answer later ones at once (closed).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import select
import socket
import struct
import sys
from pathlib import Path

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1
RESOLVER = "127.0.0.1"

libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _own_namespaces() -> None:
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNS | CLONE_NEWNET | (0 if uid == 0 else CLONE_NEWUSER)
    _check(libc.unshare(flags), "unshare")
    if uid != 0:  # the same uid inside: the command is still this normal user
        Path("/proc/self/setgroups").write_text("deny")
        Path("/proc/self/uid_map").write_text(f"{uid} {uid} 1")
        Path("/proc/self/gid_map").write_text(f"{gid} {gid} 1")
    _check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")


def _loopback_up() -> None:
    with socket.socket() as probe:
        request = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(probe, SIOCGIFFLAGS, request + b"\0" * 22)[:18])[1]
        fcntl.ioctl(probe, SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | IFF_UP) + b"\0" * 22)


def _resolver_config(control: Path) -> None:
    config = control / "resolv.conf"
    config.write_text(f"nameserver {RESOLVER}\noptions use-vc attempts:1\n")
    _check(libc.mount(str(config).encode(), b"/etc/resolv.conf", None, MS_BIND, None),
           "bind resolv.conf")


def _serve(listener: socket.socket, control: Path) -> None:
    """Hold every connection until CONTROL_DIR/release exists; exit with the parent."""
    parent = os.getppid()
    held: list[socket.socket] = []
    released = False

    def report() -> None:
        (control / "held.new").write_text(str(len(held)))
        os.replace(control / "held.new", control / "held")

    report()
    while os.getppid() == parent:
        ready, _, _ = select.select([listener], [], [], 0.1)
        if ready:
            connection, _ = listener.accept()
            if released:
                connection.close()
            else:
                held.append(connection)
                report()
        if not released and (control / "release").exists():
            released = True
            for connection in held:
                connection.close()
            held.clear()
            report()
    os._exit(0)


def main() -> None:
    control = Path(sys.argv[1])
    command = sys.argv[sys.argv.index("--") + 1:]
    _own_namespaces()
    _loopback_up()
    _resolver_config(control)
    listener = socket.socket()
    listener.bind((RESOLVER, 53))  # allowed: the network namespace is ours
    listener.listen(512)
    if os.fork() == 0:
        _serve(listener, control)
    listener.close()
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()
