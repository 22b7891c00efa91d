"""A sandbox an engine takes over after a restart keeps its egress closed to the engine's
own API (issue 30, item 6): the new engine's port, on a new address, is refused like the
old one was, under a rule that allows the host's loopback on every port."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from attack_helpers import ONCE
from engine_helpers import destroy_every_sandbox, start_engine, stop_process
from sandbox_kernel.api import CreateSandboxRequest, SandboxClient
from sandbox_kernel.api.local_engine import HOST_ALIAS
from sandbox_kernel.local.egress_proxy import BLOCKED_REASON

pytestmark = [pytest.mark.slow, ONCE]

# In the sandbox: ask the egress proxy to CONNECT to each target; its status line.
CONNECT = r'''
import json, socket, sys
answers = {}
for target in sys.argv[1:]:
    s = socket.create_connection(("127.0.0.1", 3128), timeout=20)
    s.sendall(f"CONNECT {target} HTTP/1.1\r\n\r\n".encode())
    answers[target] = s.recv(4096).decode(errors="replace")
    s.close()
print(json.dumps(answers))
'''


@pytest.fixture
def host_server() -> Iterator[int]:
    """Something else on the host's loopback: the rule really opens the host to the sandbox."""
    server = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=lambda: [server.accept() for _ in iter(int, 1)], daemon=True).start()
    yield server.getsockname()[1]
    server.close()


async def connect_from(endpoint, sandbox: str, *targets: str) -> dict[str, str]:
    async with SandboxClient(endpoint.url, endpoint.token) as api:
        result = (await api.exec(sandbox, "python3", ["-c", CONNECT, *targets])).result
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


async def test_an_adopted_sandbox_cannot_reach_the_new_engines_api(tmp_path: Path, host_server: int) -> None:
    first, endpoint = start_engine(tmp_path, {})
    second = None
    try:
        async with SandboxClient(endpoint.url, endpoint.token) as api:
            sandbox = (await api.create_sandbox(CreateSandboxRequest(
                shape="s-1vcpu-256mb", egress=[HOST_ALIAS]))).id  # the host's loopback, every port
        old_port = urlsplit(endpoint.url).port
        before = await connect_from(endpoint, sandbox, f"{HOST_ALIAS}:{old_port}", f"{HOST_ALIAS}:{host_server}")
        assert before[f"{HOST_ALIAS}:{host_server}"].startswith("HTTP/1.1 200")  # the rule opens the host
        assert before[f"{HOST_ALIAS}:{old_port}"].startswith("HTTP/1.1 403")
        stop_process(first, 15)  # the sandbox runs on; the next engine takes it over
        second, endpoint = start_engine(tmp_path, {})
        new_port = urlsplit(endpoint.url).port
        after = await connect_from(endpoint, sandbox, f"{HOST_ALIAS}:{new_port}", f"{HOST_ALIAS}:{host_server}")
        assert after[f"{HOST_ALIAS}:{host_server}"].startswith("HTTP/1.1 200")  # adopted, egress working
        refused = after[f"{HOST_ALIAS}:{new_port}"]
        assert refused.startswith("HTTP/1.1 403") and BLOCKED_REASON in refused, after
    finally:
        stop_process(first, 15)
        if second is None:  # only an engine on the state dir can end the sandbox it left
            second, endpoint = start_engine(tmp_path, {})
        destroy_every_sandbox(endpoint)
        stop_process(second, 15)
