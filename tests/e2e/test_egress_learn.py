"""%egress learn / suggest, %sandbox sweep and %sandbox seal, through a real kernel and the
local engine.

Three HTTP servers on the host's loopback (A, B, C) stand for the outside world: the sandbox
reaches them only through the engine's egress proxy, by the host alias.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from jupyter_client.blocking.client import BlockingKernelClient

from named_servers import FETCH, named_servers
from kernel_helpers import execute, running_kernel
from package_index import PACKAGE, serving_index
from sandbox_kernel.api import SandboxClient, names
from sandbox_kernel.kernel.egress_learning import MAX_DESTINATIONS
from sandbox_kernel.api.local_engine import HOST_ALIAS
from sandbox_kernel.local.service import EngineEndpoint
from sandbox_kernel.sandbox.sealed import kernel_arguments

pytestmark = pytest.mark.slow
PIP = f"--no-cache-dir --disable-pip-version-check --trusted-host {HOST_ALIAS} --index-url"


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[int, ...]]:
    with named_servers("A", "B", "C") as ports:
        yield ports



# Asks the in-sandbox proxy port for `count` distinct destinations, one CONNECT each; prints
# how many the engine answered (403: refused, and seen).
MANY_DESTINATIONS = """
import socket
answered = 0
for i in range(FIRST, FIRST + COUNT):
    with socket.create_connection(("127.0.0.1", 3128), timeout=30) as s:
        s.sendall(f"CONNECT d{i}.example.com:443 HTTP/1.1\\r\\nHost: d{i}.example.com:443\\r\\n\\r\\n".encode())
        answered += s.recv(200).split(b"\\r\\n", 1)[0].split()[1:2] == [b"403"]
print("answered", answered)
"""


def out(kc: BlockingKernelClient, code: str) -> str:
    result = execute(kc, code)
    assert result.reply["content"]["status"] == "ok", result.of_type("error") or result.text("stderr")
    return result.text()


def next_input(kc: BlockingKernelClient, code: str) -> str:
    result = execute(kc, code)
    assert result.reply["content"]["status"] == "ok", result.text("stderr")
    (payload,) = [item for item in result.reply["content"]["payload"] if item["source"] == "set_next_input"]
    return payload["text"]


def sandboxes(engine: EngineEndpoint) -> list:
    async def listed() -> list:
        async with SandboxClient(engine.url, engine.token) as client:
            return names.live(await client.list_sandboxes())
    return asyncio.run(listed())


def destroy(engine: EngineEndpoint, sandbox_id: str) -> None:
    async def gone() -> None:
        async with SandboxClient(engine.url, engine.token) as client:
            await client.delete_sandbox(sandbox_id)
    asyncio.run(gone())


def destinations(engine: EngineEndpoint, sandbox_id: str):  # type: ignore[no-untyped-def]
    async def asked() -> object:
        async with SandboxClient(engine.url, engine.token) as client:
            return await client.egress_destinations(sandbox_id)
    return asyncio.run(asked())


def sandbox_id_of(kc: BlockingKernelClient) -> str:
    status = execute(kc, "%sandbox status").of_type("display_data")[0]["data"]["text/plain"]
    return status.splitlines()[0].split()[1]


def test_learn_then_suggest_gives_the_line_that_allows_exactly_what_was_reached(
        kernelspec: str, servers: tuple[int, int, int]) -> None:
    a, b, c = servers
    rules = f"127.0.0.1:{a},127.0.0.1:{b}"
    with running_kernel(kernelspec, extra_arguments=[f"--SandboxKernel.egress={rules}"]) as (_, kc):
        out(kc, FETCH)
        assert "recording the destinations" in out(kc, "%egress learn")
        assert out(kc, f"print(fetch({a}), fetch({b}))") == "A B\n"
        assert out(kc, f"print(fetch({a}))") == "A\n"
        line = next_input(kc, "%egress suggest")
        # names as the sandbox asked for them, exact ports, in the order first reached
        assert line == f"%egress only {HOST_ALIAS}:{a} {HOST_ALIAS}:{b}"
        stopped = execute(kc, "%egress learn --stop")
        shown = stopped.of_type("display_data")[0]["data"]["text/plain"].splitlines()
        # destination, connections, the cells (execution counts 3 and 4) that reached it
        assert [row.split(None, 2) for row in shown[1:]] == [[f"{HOST_ALIAS}:{a}", "2", "cell 3, 4"],
                                                            [f"{HOST_ALIAS}:{b}", "1", "cell 3"]], shown
        out(kc, line)
        assert out(kc, f"print(fetch({a}), fetch({b}), fetch({c}))") == "A B HTTP 403\n"


def test_a_package_install_during_learning_counts_its_index(kernelspec: str, tmp_path: Path) -> None:
    """pip goes through the egress proxy like every client (a subprocess of the cell): the
    index it used is in the suggestion, by the name pip asked for."""
    with serving_index(tmp_path / "index") as index, running_kernel(kernelspec) as (_, kc):
        port = index.split(":")[2].split("/")[0]
        out(kc, f"%egress only 127.0.0.1:{port}")
        out(kc, "%egress learn")
        install = execute(kc, f"%pip install {PIP} {index} {PACKAGE}")
        assert "Successfully installed hello-sandbox-1.0" in install.text(), install.outputs
        assert next_input(kc, "%egress suggest") == f"%egress only {HOST_ALIAS}:{port}"


def test_learning_keeps_at_most_the_cap_and_says_so_once(kernelspec: str, engine: EngineEndpoint) -> None:
    """Attack: a cell asks for more distinct destinations than the table holds. The cell
    proves every request reached the engine; the engine and the kernel keep MAX_DESTINATIONS
    and the cell says so once."""
    over = MAX_DESTINATIONS + 150
    with running_kernel(kernelspec, extra_arguments=["--SandboxKernel.egress=127.0.0.1:9"]) as (_, kc):
        sandbox_id = sandbox_id_of(kc)
        out(kc, "%egress learn")
        flood = execute(kc, MANY_DESTINATIONS.replace("FIRST", "0").replace("COUNT", str(over)), timeout=600)
        assert flood.text() == f"answered {over}\n", flood.outputs  # every one was asked for, and refused
        cap_lines = [line for line in flood.text("stderr").splitlines() if "records at most" in line]
        assert cap_lines == [f"sandbox-kernel: %egress learn records at most {MAX_DESTINATIONS} destinations: "
                             "the sandbox reached more, which are not recorded"]
        seen = destinations(engine, sandbox_id)
        assert len(seen.destinations) == MAX_DESTINATIONS and seen.dropped == over - MAX_DESTINATIONS
        more = execute(kc, MANY_DESTINATIONS.replace("FIRST", str(over)).replace("COUNT", "20"))
        assert more.text() == "answered 20\n"
        assert "records at most" not in more.text("stderr"), "said once"
        table = execute(kc, "%egress learn --stop").of_type("display_data")[0]["data"]["text/plain"]
        assert len(table.splitlines()) == MAX_DESTINATIONS + 1  # the header and the cap's worth
        assert "d0.example.com:443" in table and f"d{over}.example.com" not in table


def test_sweep_runs_the_code_in_one_fork_per_value_and_leaves_no_fork(
        kernelspec: str, engine: EngineEndpoint) -> None:
    with running_kernel(kernelspec) as (_, kc):
        out(kc, "import os\nstate = os.urandom(4).hex()\nprint(state)")
        state = out(kc, "print(state)").strip()
        source = sandbox_id_of(kc)
        result = execute(kc, "%sandbox sweep -p x 1 2 3 --jobs 2 -- (state, x * 10)")
        assert result.reply["content"]["status"] == "ok", result.text("stderr")
        rows = result.of_type("display_data")[-1]["data"]["text/plain"].splitlines()
        assert [row.split(None, 2) for row in rows[1:]] == [
            [f"x={x}", "ok", f"('{state}', {x * 10})"] for x in (1, 2, 3)], rows
        assert not [view.id for view in sandboxes(engine) if view.forked_from == source]
        assert out(kc, "print(state)").strip() == state  # the source goes on, untouched

        kept = execute(kc, "%sandbox sweep -p x 7 --keep -- x")
        row = kept.of_type("display_data")[-1]["data"]["text/plain"].splitlines()[1].split()
        assert row[:3] == ["x=7", "ok", "7"]
        forks = [view.id for view in sandboxes(engine) if view.forked_from == source]
        assert forks == [row[3]]
        listed = execute(kc, "%sandbox list").of_type("display_data")[0]["data"]["text/plain"]
        assert "kept" in next(line for line in listed.splitlines() if row[3] in line), listed
    destroy(engine, row[3])  # kept: the kernel's shutdown left it
    assert not [view.id for view in sandboxes(engine) if view.forked_from == source]


def test_interrupting_a_sweep_destroys_its_forks(kernelspec: str, engine: EngineEndpoint) -> None:
    with running_kernel(kernelspec) as (km, kc):
        out(kc, "import time")
        source = sandbox_id_of(kc)
        msg_id = kc.execute("%sandbox sweep -p x 1 2 --jobs 2 -- time.sleep(600)")
        deadline = time.monotonic() + 120
        while len([view for view in sandboxes(engine) if view.forked_from == source]) < 2:
            assert time.monotonic() < deadline, "the sweep never made its forks"
            time.sleep(0.2)
        time.sleep(1)  # the branches' code runs in the forks
        km.interrupt_kernel()
        while (reply := kc.get_shell_msg(timeout=120))["parent_header"].get("msg_id") != msg_id:
            pass
        assert reply["content"]["ename"] == "KeyboardInterrupt"
        assert not [view.id for view in sandboxes(engine) if view.forked_from == source]
        assert out(kc, "print('alive')") == "alive\n"


def test_seal_round_trips_through_kernel_arguments(kernelspec: str, servers: tuple[int, int, int]) -> None:
    a, _, _ = servers
    with running_kernel(kernelspec) as (_, kc):
        out(kc, f"%egress only 127.0.0.1:{a} {HOST_ALIAS}:{a}")
        result = execute(kc, "%sandbox seal")
        assert "Notebook metadata" in result.text()
        text = [item for item in result.reply["content"]["payload"] if item["source"] == "set_next_input"][0]["text"]
        metadata = json.loads(text)
        assert metadata["sandbox"]["egress"] == [f"127.0.0.1:{a}", f"{HOST_ALIAS}:{a}"]
        arguments = kernel_arguments(metadata, environ=os.environ)
        assert f"--SandboxKernel.egress=127.0.0.1:{a},{HOST_ALIAS}:{a}" in arguments
        assert f"--SandboxKernel.shape={metadata['sandbox']['shape']}" in arguments
