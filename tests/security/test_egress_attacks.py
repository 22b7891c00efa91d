"""Egress attacks from inside a sandbox, through its proxy (issue 12, item 3): data out
through DNS under block-all, block-all's own address, the engine's port under other
spellings of the host, and a tunnel kept open across a rule change.

Host servers on 127.0.0.1 stand for the outside world. Each attack first shows the path
it uses is real (a rule that allows it lets it through), then that it is refused.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from urllib.parse import urlsplit

import pytest

from attack_helpers import ONCE
from sandbox_kernel.api import CreateSandboxRequest, SandboxClient
from sandbox_kernel.api.egress_rules import DENY_ALL
from sandbox_kernel.local.egress_proxy import BLOCKED_REASON
from sandbox_kernel.local.service import EngineEndpoint

pytestmark = [pytest.mark.slow, ONCE]

# Run in the sandbox: ask the proxy for each target, print what it answered, as JSON.
PROBE = r'''
import json, socket, struct, sys

def connect(target):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=20)
    s.sendall(f"CONNECT {target} HTTP/1.1\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        data = s.recv(4096)
        if not data:
            break
        head += data
    status, _, rest = head.partition(b"\r\n\r\n")
    code = int(status.split()[1]) if status else 0
    if code == 200:
        s.sendall(b"ping\n")
        rest = s.recv(100)
    else:
        while data := s.recv(4096):
            rest += data
    s.close()
    return [code, rest.decode(errors="replace").strip()]

def socks(host, port):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=20)
    s.sendall(b"\x05\x01\x00")
    assert s.recv(2) == b"\x05\x00"
    name = host.encode()
    s.sendall(b"\x05\x01\x00\x03" + bytes([len(name)]) + name + struct.pack(">H", port))
    return s.recv(10)[1]

targets = json.loads(sys.argv[1])
print(json.dumps({t: connect(t) for t in targets["connect"]}
                 | {f"socks {h}:{p}": socks(h, p) for h, p in targets.get("socks", [])}))
'''


@pytest.fixture(scope="module")
def echo() -> Iterator[int]:
    """A TCP server on the host's loopback that echoes each connection's first line,
    then keeps the connection open until the other side closes it."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(4096):
                conn.sendall(data)

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield server.getsockname()[1]
    server.close()


@pytest.fixture
async def sandbox(client: SandboxClient) -> AsyncIterator[str]:
    created = await client.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-512mb"))
    yield created.id
    await client.delete_sandbox(created.id)


async def probe(client: SandboxClient, sandbox: str, rules: list[str], connect: list[str],
                socks: list[tuple[str, int]] = ()) -> dict:
    await client.set_egress(sandbox, rules)
    response = await client.exec(sandbox, "python3", ["-c", PROBE, json.dumps(
        {"connect": connect, "socks": list(socks)})])
    assert response.result.exit_code == 0, response.result.stderr
    return json.loads(response.result.stdout)


async def test_block_all_refuses_names_without_resolving_them(client: SandboxClient, sandbox: str,
                                                              echo: int) -> None:
    target = f"localhost:{echo}"
    # The path is real: under a CIDR rule the name is resolved on the host (the reason
    # names the address it resolved to) and reaches the host server.
    opened = await probe(client, sandbox, ["127.0.0.0/8"], [target])
    assert opened[target] == [200, "ping"]
    resolved = await probe(client, sandbox, ["10.0.0.0/8"], [target])
    assert resolved[target][0] == 403 and "(127.0.0.1)" in resolved[target][1]
    # Block-all, and a list whose host rules do not name it: refused before resolving
    # (no address in the reason), as refusals, counted.
    before = (await client.get_egress(sandbox)).denied_count
    for rules, reason in (([DENY_ALL], "all egress is blocked (block-all)"),
                          (["allowed.example"], f"no rule allows {target}")):
        found = await probe(client, sandbox, rules, [target, f"leak-{sandbox}.example:53"],
                            socks=[("localhost", echo)])
        assert found[target] == [403, f"egress denied: {target}: {reason}"]
        assert found[f"leak-{sandbox}.example:53"][0] == 403
        assert found[f"socks localhost:{echo}"] == 2  # "connection not allowed by ruleset"
    assert (await client.get_egress(sandbox)).denied_count == before + 6


async def test_block_all_is_not_a_destination(client: SandboxClient, sandbox: str, echo: int) -> None:
    literal = f"127.0.0.1:{echo}"
    assert (await probe(client, sandbox, [literal], [literal]))[literal] == [200, "ping"]
    found = await probe(client, sandbox, [DENY_ALL], [DENY_ALL, literal])
    for target in (DENY_ALL, literal):
        assert found[target] == [403, f"egress denied: {target}: all egress is blocked (block-all)"]


async def test_the_engine_port_is_closed_on_every_host_address(client: SandboxClient, sandbox: str,
                                                               engine: EngineEndpoint, echo: int) -> None:
    engine_port = urlsplit(engine.url).port
    spellings = ["0", "0.0.0.0", "[::ffff:0.0.0.0]", "[::ffff:127.0.0.1]", "127.0.0.2", "[::1]", "localhost"]
    rules = ["0.0.0.0/0", "::/0", "localhost"]
    # These spellings do reach the host's 127.0.0.1, where the echo server listens.
    reach = await probe(client, sandbox, rules, [f"{host}:{echo}" for host in spellings[:4]])
    assert all(answer == [200, "ping"] for answer in reach.values()), reach
    found = await probe(client, sandbox, rules, [f"{host}:{engine_port}" for host in spellings])
    for target, answer in found.items():
        assert answer == [403, f"egress denied: {target}: {BLOCKED_REASON}"], target


async def test_a_tunnel_is_cut_when_the_rules_change(client: SandboxClient, sandbox: str, echo: int) -> None:
    target = f"127.0.0.1:{echo}"
    await client.set_egress(sandbox, [target])
    hold = PROBE.split("targets = ")[0] + f'''
s = socket.create_connection(("127.0.0.1", 3128), timeout=60)
s.sendall(b"CONNECT {target} HTTP/1.1\\r\\n\\r\\n")
assert s.recv(4096).startswith(b"HTTP/1.1 200")
s.sendall(b"ping\\n")
print("echoed", s.recv(100).strip().decode(), flush=True)
print("then", s.recv(100) or "closed", flush=True)
'''
    output = ""
    async with client.exec_stream(sandbox, "python3", ["-c", hold]) as frames:
        async for frame in frames:
            output += frame.stdout or ""
            if "echoed ping" in output and "changed" not in output:
                output += "changed\n"
                await client.set_egress(sandbox, ["127.0.0.1:1"])
            if frame.exit_code is not None:
                break
    assert output.splitlines() == ["echoed ping", "changed", "then closed"]
    denial = (await client.get_egress(sandbox)).denied[-1]
    assert denial.reason.startswith("cut after a rule change: no rule allows")
