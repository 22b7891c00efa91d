"""The local engine can go away without taking the sandboxes: SIGKILL it between cells and
mid-cell, and the notebook carries on with its variables, files and running cell, on the
same sandbox, none orphaned or duplicated.

On the local engine path the kernel restarts the engine by itself (as it starts it on
demand); on the CreateOS code path the kernel only knows a URL, so the test starts the new
engine on the same port, as a cloud service comes back at its address.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jupyter_client import BlockingKernelClient
from jupyter_client.manager import start_new_kernel

from engine_helpers import stop_process
from kernel_helpers import TIMEOUT, execute
from sandbox_kernel.api import APITransportError, CreateSandboxRequest, SandboxClient
from sandbox_kernel.config import LOCAL_ENGINE_URL_FOR_UDS
from sandbox_kernel.local.registry import start_time
from sandbox_kernel.local.service import (
    ENGINE_FILE,
    SOCKET_FILE,
    EngineEndpoint,
    EngineRestarting,
    ensure_engine,
    load_or_create_token,
    read_endpoint,
    stop_engine,
)

pytestmark = pytest.mark.slow


def engine_of(state: Path) -> EngineEndpoint:
    deadline = time.monotonic() + 30
    while (endpoint := read_endpoint(state)) is None:
        assert time.monotonic() < deadline, "no engine answers"
        time.sleep(0.05)
    return endpoint


def kill_engine(state: Path) -> None:
    pid = engine_of(state).pid
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while start_time(pid) is not None and time.monotonic() < deadline:
        time.sleep(0.02)  # until gone, or a zombie (an engine this test started stays one)


def sandboxes(endpoint: EngineEndpoint) -> list[tuple[str, str]]:
    async def listed() -> list[tuple[str, str]]:
        async with SandboxClient(endpoint.url, endpoint.token) as api:
            return [(view.id, view.status.value) for view in await api.list_sandboxes()]
    return asyncio.run(listed())


def exec_in(endpoint: EngineEndpoint, sandbox_id: str, script: str) -> None:
    async def run() -> None:
        async with SandboxClient(endpoint.url, endpoint.token) as api:
            assert (await api.exec(sandbox_id, "sh", ["-c", script])).result.exit_code == 0
    asyncio.run(run())


class Service:
    """How an engine comes back after it was killed, per path."""

    def __init__(self, via: str, state: Path) -> None:
        self.via, self.state = via, state
        self.process: subprocess.Popen | None = None

    def start(self, port: int = 0) -> EngineEndpoint:
        if self.via == "local engine":
            return ensure_engine(self.state, idle_timeout=120)
        log = open(self.state / "engine.log", "ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "sandbox_kernel", "serve", "--state-dir", str(self.state), "--port", str(port)],
            stdout=log, stderr=log, start_new_session=True)
        return engine_of(self.state)

    def restart(self, port: int) -> EngineEndpoint:
        """After a kill: the kernel brings the local engine back itself; a CreateOS URL needs us."""
        return engine_of(self.state) if self.via == "local engine" else self.start(port)

    def stop(self) -> None:
        stop_engine(self.state)
        if self.process is not None:
            stop_process(self.process, 15)


@pytest.fixture(params=["local engine", "CreateOS code path"])
def service(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Service]:
    running = Service(request.param, tmp_path)
    yield running
    running.stop()


def test_a_killed_engine_takes_nothing_from_the_notebook(kernelspec: str, service: Service,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    first = service.start()
    port = int(first.url.rsplit(":", 1)[1])
    monkeypatch.setenv("SANDBOX_KERNEL_STATE_DIR", str(service.state))
    if service.via == "CreateOS code path":
        monkeypatch.setenv("CREATEOS_SANDBOX_BASE_URL", first.url)
        monkeypatch.setenv("CREATEOS_SANDBOX_API_KEY", first.token)
    else:
        monkeypatch.delenv("CREATEOS_SANDBOX_API_KEY", raising=False)
    km, kc = start_new_kernel(kernel_name=kernelspec, startup_timeout=TIMEOUT)
    try:
        sandbox_id = execute(kc, "import os, time\nprint(os.environ['SANDBOX_ID'])").text().strip()
        execute(kc, "x = 41\nopen('/workspace/f', 'w').write('files too')")

        # Between cells.
        kill_engine(service.state)
        if service.via == "CreateOS code path":
            service.restart(port)
        assert execute(kc, "print(x + 1, open('/workspace/f').read())").text() == "42 files too\n"
        assert sandboxes(engine_of(service.state)) == [(sandbox_id, "running")]

        # Mid-cell: the cell waits for a file only the test makes, after the engine is back.
        cell = kc.execute("print('before', flush=True)\n"
                          "while not os.path.exists('/tmp/go'):\n    time.sleep(0.02)\nprint('after', x)")
        texts = wait_for_output(kc, cell, "before")
        kill_engine(service.state)
        exec_in(service.restart(port) if service.via == "CreateOS code path" else ensure_engine(service.state),
                sandbox_id, "touch /tmp/go")
        reply, more = finish(kc, cell)
        assert reply["content"]["status"] == "ok", more
        assert texts + more == "before\nafter 41\n"  # everything, once
        assert sandboxes(engine_of(service.state)) == [(sandbox_id, "running")]
    finally:
        kc.stop_channels()
        km.shutdown_kernel()
    assert sandboxes(engine_of(service.state)) == []  # its shutdown destroyed it, on the new engine


def wait_for_output(kc: BlockingKernelClient, msg_id: str, text: str) -> str:
    seen = ""
    while text not in seen:
        msg = kc.get_iopub_msg(timeout=TIMEOUT)
        if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
            seen += msg["content"]["text"]
    return seen


def finish(kc: BlockingKernelClient, msg_id: str) -> tuple[dict, str]:
    """The cell's reply, and the stream text it printed meanwhile."""
    text = ""
    while True:
        msg = kc.get_iopub_msg(timeout=TIMEOUT)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            text += msg["content"]["text"]
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return kc.get_shell_msg(timeout=TIMEOUT), text


# A fake engine on the socket (argv[1]) that writes each request's first line to argv[2].
LISTENS = """
import os, socket, sys
def read_request(connection):
    data = b""
    while b"\\r\\n\\r\\n" not in data:
        data += connection.recv(65536)
    head, _, body = data.partition(b"\\r\\n\\r\\n")
    lines = head.split(b"\\r\\n")
    length = int(next((line.split(b":")[1] for line in lines if line.lower().startswith(b"content-length:")), b"0"))
    while len(body) < length:
        body += connection.recv(65536)
    open(sys.argv[2], "wb").write(lines[0])
listener = socket.socket(socket.AF_UNIX)
listener.bind(sys.argv[1])
listener.listen()
print("listening", flush=True)
"""
# An engine that dies after reading one whole request, before answering it: where a kill can
# land between an engine acting on a request and its answer.
DIES_HOLDING_A_REQUEST = LISTENS + """
connection, _ = listener.accept()
read_request(connection)
os._exit(0)
"""
# It lives on: each connection is dropped once its request is read.
DROPS_EVERY_REQUEST = LISTENS + """
while True:
    connection, _ = listener.accept()
    read_request(connection)
    connection.close()
"""


@contextlib.contextmanager
def fake_engine(script: str, state: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """A fake engine (one of the scripts above) listening on state's socket, and the file it
    writes each request's first line to."""
    socket_path, request_line = state / SOCKET_FILE, state / "request-line"
    process = subprocess.Popen([sys.executable, "-c", script, str(socket_path), str(request_line)],
                               stdout=subprocess.PIPE)
    try:
        assert process.stdout is not None and process.stdout.readline() == b"listening\n"
        yield process, request_line
    finally:
        process.kill()
        process.wait()


def client_of(fake: subprocess.Popen[bytes], state: Path, **options: Any) -> SandboxClient:
    """The kernel's client of the local engine, that fake being the engine it knows."""
    transport = EngineRestarting(str(state / SOCKET_FILE), state, idle_timeout=60, engine_pid=fake.pid)
    return SandboxClient(LOCAL_ENGINE_URL_FOR_UDS, load_or_create_token(state), transport=transport, **options)


@pytest.mark.parametrize("method", ["POST", "GET"])
async def test_an_engine_that_died_holding_a_request_gets_it_again_only_if_harmless(tmp_path: Path,
                                                                                   method: str) -> None:
    """The kernel's transport starts the next engine either way, but sends a sandbox create
    again only if it cannot have been read: a second one would leave the first orphaned."""
    try:
        with fake_engine(DIES_HOLDING_A_REQUEST, tmp_path) as (dying, request_line):
            async with client_of(dying, tmp_path) as api:
                if method == "POST":
                    with pytest.raises(APITransportError):
                        await api.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-1gb"))
                else:
                    assert await api.list_sandboxes() == []  # answered by the next engine
            assert request_line.read_bytes().startswith(f"{method} /v1/sandboxes".encode())  # read whole, then died
        next_engine = await asyncio.to_thread(engine_of, tmp_path)
        assert await asyncio.to_thread(sandboxes, next_engine) == []  # and holds no second sandbox
    finally:
        stop_engine(tmp_path)


async def test_a_live_engine_that_dropped_a_request_is_neither_replaced_nor_asked_again(tmp_path: Path) -> None:
    """It may have acted on the request: the caller hears the error, and no engine is started
    in its place (it still takes connections)."""
    with fake_engine(DROPS_EVERY_REQUEST, tmp_path) as (live, request_line):
        async with client_of(live, tmp_path, max_retries=0) as api:
            with pytest.raises(APITransportError):
                await api.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-1gb"))
        assert request_line.read_bytes().startswith(b"POST /v1/sandboxes")
        assert live.poll() is None and not (tmp_path / ENGINE_FILE).exists()  # no engine in its place
