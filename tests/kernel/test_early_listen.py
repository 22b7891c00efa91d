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


def _early_client(context: zmq.Context[Any], port: int) -> zmq.Socket[Any]:
    client = context.socket(zmq.DEALER)
    client.setsockopt(zmq.RECONNECT_IVL, -1)
    client.setsockopt(zmq.LINGER, 0)
    client.connect(f"tcp://{IP}:{port}")
    return client


def test_a_request_sent_before_ipykernel_binds_reaches_its_socket(tmp_path: Path, context: zmq.Context[Any]) -> None:
    connection_file = _connection_file(tmp_path)
    ports = json.loads(Path(connection_file).read_text())
    early_listen.listen(connection_file_argument(["-f", connection_file]))
    client = _early_client(context, ports["shell_port"])
    client.send(b"kernel_info_request, sent early")
    shell = context.socket(zmq.ROUTER)
    shell.setsockopt(zmq.LINGER, 0)
    assert _app()._bind_socket(shell, ports["shell_port"]) == ports["shell_port"]
    assert shell.poll(30_000), "the early request never reached the bound socket"
    assert shell.recv_multipart()[-1] == b"kernel_info_request, sent early"
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
    connection_file = _connection_file(tmp_path, shell_port=taken_port, iopub_port=0)
    early_listen.listen(connection_file)
    early_listen.listen(str(tmp_path / "no-such-file.json"))
    taken.close()  # free again: ipykernel's own bind takes it
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    assert _app()._bind_socket(router, taken_port) == taken_port
    client = context.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    client.connect(f"tcp://{IP}:{taken_port}")
    client.send(b"bound by zmq itself")
    assert router.poll(30_000) and router.recv_multipart()[-1] == b"bound by zmq itself"


def test_only_tcp_connection_files_are_listened_on(tmp_path: Path) -> None:
    connection_file = _connection_file(tmp_path, transport="ipc", ip="kernel-ipc")
    early_listen.listen(connection_file)
    assert early_listen.take("kernel-ipc", json.loads(Path(connection_file).read_text())["shell_port"]) is None
