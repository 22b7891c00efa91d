"""The kernel's ports listen from the process's first moments (kernel/early_listen.py), and
ipykernel's zmq sockets are bound onto those listeners (kernel/app.py).

The clients here never reconnect (ZMQ_RECONNECT_IVL -1): a connection made before ipykernel
binds is one the listener took, or it is lost for good. With the listener, a request sent
that early is answered once the zmq socket is bound."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from ipykernel.kernelapp import IPKernelApp

from sandbox_kernel.kernel import app as kernel_app
from sandbox_kernel.kernel import early_listen
from sandbox_kernel.paths import connection_file_argument

IP = "127.0.0.1"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind((IP, 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def context() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture(autouse=True)
def no_listeners_left() -> Iterator[None]:
    yield
    early_listen.close_unused()


def _connection_file(tmp_path: Path, **fields: Any) -> str:
    info = {"transport": "tcp", "ip": IP, "shell_port": _free_port(), "iopub_port": _free_port(),
            "stdin_port": _free_port(), "control_port": _free_port(), "hb_port": _free_port(), **fields}
    path = tmp_path / "kernel-test.json"
    path.write_text(json.dumps(info))
    return str(path)


def _app() -> IPKernelApp:
    """ipykernel's app, for its own _bind_socket (not the process's singleton)."""
    app = IPKernelApp()
    app.ip, app.transport = IP, "tcp"
    kernel_app._bind_onto_early_listeners(app)
    return app


def _socket(context: zmq.Context[Any], kind: int) -> zmq.Socket[Any]:
    socket_ = context.socket(kind)
    socket_.setsockopt(zmq.LINGER, 0)
    return socket_


def _client(context: zmq.Context[Any], port: int, *, reconnects: bool = True) -> zmq.Socket[Any]:
    """(Kept by the caller: a socket collected is closed, its unsent message dropped.)"""
    client = _socket(context, zmq.DEALER)
    if not reconnects:
        client.setsockopt(zmq.RECONNECT_IVL, -1)
    client.connect(f"tcp://{IP}:{port}")
    return client


def _received(router: zmq.Socket[Any], message: bytes) -> bool:
    return bool(router.poll(30_000)) and router.recv_multipart()[-1] == message


def test_a_request_sent_before_ipykernel_binds_reaches_its_socket(tmp_path: Path, context: zmq.Context[Any]) -> None:
    connection_file = _connection_file(tmp_path)
    ports = json.loads(Path(connection_file).read_text())
    early_listen.listen(connection_file_argument(["-f", connection_file]))
    client = _client(context, ports["shell_port"], reconnects=False)
    client.send(b"kernel_info_request, sent early")
    shell = _socket(context, zmq.ROUTER)
    assert _app()._bind_socket(shell, ports["shell_port"]) == ports["shell_port"]
    assert _received(shell, b"kernel_info_request, sent early"), "the early request never reached the bound socket"
    # The other ports listen too, and a port ipykernel did not take is let go.
    for name in ("iopub_port", "stdin_port", "control_port"):
        with socket.create_connection((IP, ports[name]), timeout=10):
            pass
    early_listen.close_unused()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((IP, ports["iopub_port"]), timeout=10)


def test_ports_that_cannot_be_had_early_are_bound_by_ipykernel_as_before(tmp_path: Path,
                                                                        context: zmq.Context[Any]) -> None:
    """A port taken meanwhile, a port of 0 (ipykernel picks one) or no connection file at
    all: nothing listens early, and ipykernel's bind is unchanged."""
    taken = socket.socket()
    taken.bind((IP, 0))
    taken_port = taken.getsockname()[1]
    early_listen.listen(_connection_file(tmp_path, shell_port=taken_port, iopub_port=0))
    early_listen.listen(str(tmp_path / "no-such-file.json"))
    taken.close()  # free again: ipykernel's own bind takes it
    router = _socket(context, zmq.ROUTER)
    assert _app()._bind_socket(router, taken_port) == taken_port
    client = _client(context, taken_port)
    client.send(b"bound by zmq itself")
    assert _received(router, b"bound by zmq itself")


def test_an_app_told_another_address_binds_its_own_socket(tmp_path: Path, context: zmq.Context[Any]) -> None:
    """`--ip` on the command line over the connection file's: the listener on the file's
    address is closed, not left holding the port against zmq's own bind."""
    connection_file = _connection_file(tmp_path)
    port = json.loads(Path(connection_file).read_text())["shell_port"]
    early_listen.listen(connection_file)
    app = _app()
    app.ip = "0.0.0.0"
    router = _socket(context, zmq.ROUTER)
    assert app._bind_socket(router, port) == port
    client = _client(context, port)
    client.send(b"to zmq's own listener")
    assert _received(router, b"to zmq's own listener")


def test_only_tcp_connection_files_are_listened_on(tmp_path: Path) -> None:
    connection_file = _connection_file(tmp_path, transport="ipc", ip="kernel-ipc")
    early_listen.listen(connection_file)
    assert early_listen.take("kernel-ipc", json.loads(Path(connection_file).read_text())["shell_port"]) is None
