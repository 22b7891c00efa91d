"""Listening on the kernel's ports from the process's first moments, before ipykernel binds them.

A Jupyter client connects to a new kernel's ports as soon as it has launched it. Refused (the
kernel is still importing), zmq tries again only after its reconnect interval and a random
part of it, 100 to 200 ms; a kernel that binds its sockets just after a retry waits for the
next. Measured on a warm start: kernel_info reached the kernel 280-330 ms after the launch,
~200 ms with a client that retries every 10 ms. These plain listening sockets, made before
anything else is imported, hold the client's connections in their backlog from its first
retry on; ipykernel's zmq sockets are then bound onto them (ZMQ_USE_FD; kernel/app.py
wraps the app's _bind_socket) and finish the handshakes at once, the requests sent
meanwhile waiting in them.

Only the shell, IOPub, stdin and control ports of a TCP connection file: the heartbeat is
bound by ipykernel's own thread and context, and no client waits for it to start.
"""

from __future__ import annotations

import json
import socket

PORTS = ("shell_port", "iopub_port", "stdin_port", "control_port")
BACKLOG = 16  # a client connects each channel once; a few clients at most

_listening: dict[int, tuple[str, socket.socket]] = {}  # by port: the address listened on, the listener


def listen(connection_file: str | None) -> None:
    """Listen on the connection file's ports; a port that cannot be had now is left to
    ipykernel's own bind, which says why."""
    if connection_file is None:
        return
    try:
        with open(connection_file, encoding="utf-8") as file:
            info = json.load(file)
        ip = str(info["ip"])
    except (OSError, ValueError, KeyError, TypeError):  # no such file yet, or not ours to read
        return
    if info.get("transport", "tcp") != "tcp":
        return
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    for name in PORTS:
        port = info.get(name)
        if not isinstance(port, int) or port <= 0:
            continue
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as zmq's own listeners
            listener.bind((ip, port))
            listener.listen(BACKLOG)
        except OSError:  # taken, or an address such as "*" that only zmq reads
            listener.close()
            continue
        _listening[port] = (ip, listener)


def take(ip: str, port: int) -> int | None:
    """The listening descriptor of ip:port, now the caller's to close; None if there is none.
    One on another address of that port (the command line's --ip differs from the file's)
    is closed, so that the port is free for a bind of zmq's own."""
    address, listener = _listening.pop(port, ("", None))
    if listener is None:
        return None
    if address != ip:
        listener.close()
        return None
    return listener.detach()


def close_unused() -> None:
    """Once ipykernel has bound its sockets: a port it did not take (bound elsewhere) is let go."""
    while _listening:
        _listening.popitem()[1][1].close()
