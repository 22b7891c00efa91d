"""Egress rules, enforced outside the sandbox, from the REST API to the notebook.

Two HTTP servers on the host's loopback (ports A and B) stand for the outside world:
the sandbox reaches them only through the engine's egress proxy, by the host alias (its
own 127.0.0.1 is its own loopback), and only as the rules say.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Iterator

import pytest
from jupyter_client.blocking.client import BlockingKernelClient
from jupyter_client.manager import KernelManager

from engine_helpers import wait_status
from fault_proxy import proxied_engine
from named_servers import FETCH, named_servers
from kernel_helpers import execute, running_kernel
from sandbox_kernel.api import (
    BadRequestError,
    CreateSandboxRequest,
    ForkSandboxRequest,
    SandboxClient,
    SandboxStatus,
)
from sandbox_kernel.api import egress_rules
from sandbox_kernel.api.local_engine import HOST_ALIAS
from sandbox_kernel.local.service import EngineEndpoint

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[int, ...]]:
    with named_servers("A", "B") as ports:
        yield ports



@pytest.fixture(scope="module")
def kernel(kernelspec: str, servers: tuple[int, int]) -> Iterator[tuple[KernelManager, BlockingKernelClient]]:
    a, _ = servers
    with running_kernel(kernelspec, extra_arguments=[f"--SandboxKernel.egress=127.0.0.1:{a}"]) as pair:
        yield pair


SOCKS = """
import socket, struct
def socks(port):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=10)
    s.sendall(b"\\x05\\x01\\x00")
    assert s.recv(2) == b"\\x05\\x00"
    s.sendall(b"\\x05\\x01\\x00\\x01" + socket.inet_aton("127.0.0.1") + struct.pack(">H", port))
    reply = s.recv(10)
    if reply[1] != 0:
        return f"SOCKS refused {reply[1]}"
    s.sendall(b"GET / HTTP/1.0\\r\\nHost: x\\r\\n\\r\\n")
    data = b""
    while chunk := s.recv(4096):
        data += chunk
    return data.split(b"\\r\\n\\r\\n", 1)[1].decode()
"""


def out(kc: BlockingKernelClient, code: str) -> str:
    result = execute(kc, code)
    assert result.reply["content"]["status"] == "ok", result.of_type("error") or result.text("stderr")
    return result.text()


def test_rules_let_through_only_what_they_name(kc: BlockingKernelClient, servers: tuple[int, int]) -> None:
    a, b = servers
    out(kc, FETCH + SOCKS)
    assert out(kc, f"print(fetch({a}))") == "A\n"
    denied = out(kc, f"print(fetch({b}, detail=True))")
    assert denied.startswith(f"HTTP 403: egress denied: {HOST_ALIAS}:{b}")
    assert out(kc, f"print(socks({a}), '|', socks({b}))") == "A | SOCKS refused 2\n"
    if shutil.which("curl"):
        assert out(kc, f"!curl -s http://{HOST_ALIAS}:{a}/") == "A"
        assert out(kc, f"!curl -s -o /dev/null -w '%{{http_code}}' http://{HOST_ALIAS}:{b}/") == "403"
    # Without the proxy there is no way out: 127.0.0.1 is the sandbox's own loopback.
    assert out(kc, f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {a}), 2)\n"
                   "except OSError as e:\n    print(type(e).__name__)") == "ConnectionRefusedError\n"


def test_rules_change_live_and_refusals_are_reported(kc: BlockingKernelClient, servers: tuple[int, int]) -> None:
    a, b = servers
    out(kc, FETCH)
    assert out(kc, f"%egress allow 127.0.0.1:{b}") == f"egress: only 127.0.0.1:{a}, 127.0.0.1:{b}\n"
    assert out(kc, f"print(fetch({a}), fetch({b}))") == "A B\n"
    assert out(kc, f"%egress deny 127.0.0.1:{b}") == f"egress: only 127.0.0.1:{a}\n"
    assert out(kc, f"print(fetch({b}))").startswith("HTTP 403")
    shown = execute(kc, "%egress").of_type("display_data")[0]["data"]["text/plain"]
    assert shown.splitlines()[0].split(None, 1) == ["rules", f"only 127.0.0.1:{a}"]
    assert f"{HOST_ALIAS}:{b}  no rule allows" in shown

    opened = execute(kc, "%egress open")
    assert "every public destination is now reachable" in opened.text("stderr")
    # Allow-all is public destinations only: the host's loopback still needs a rule.
    assert "covers public destinations only" in out(kc, f"print(fetch({a}, detail=True))")
    out(kc, "%egress block-all")
    assert out(kc, f"print(fetch({a}))").startswith("HTTP 403")
    out(kc, f"%egress only 127.0.0.1:{a}")


def test_refusals_are_named_after_any_cell_with_one_line_to_permit_them(
        kc: BlockingKernelClient, servers: tuple[int, int]) -> None:
    a, b = servers
    out(kc, FETCH)
    quiet = execute(kc, f"print(fetch({a}))")
    assert quiet.text() == "A\n" and quiet.text("stderr") == "", "no refusal, no line"
    # urllib alone says only "403 Forbidden" (requests: "Tunnel connection failed: 403"); the
    # kernel says which destination and why, after a cell that is not pip, failed or not.
    closed = b + 1 if b + 1 != a else b + 2
    refused = execute(kc, "import urllib.request\n"
                          f"print(fetch({b}))\n"
                          f"urllib.request.urlopen('http://{HOST_ALIAS}:{closed}/', timeout=10)")
    assert refused.text().startswith("HTTP 403"), refused.outputs  # the refusals really happened
    assert refused.of_type("error"), "the cell failed on the second refusal"
    lines = refused.text("stderr").splitlines()
    assert lines == [f"sandbox-kernel: egress refused {HOST_ALIAS}:{closed}: no rule allows {HOST_ALIAS}:{closed}",
                     f"sandbox-kernel: egress refused {HOST_ALIAS}:{b}: no rule allows {HOST_ALIAS}:{b}",
                     f"sandbox-kernel: %egress allow {HOST_ALIAS}:{b} {HOST_ALIAS}:{closed} permits them"], lines
    assert execute(kc, f"print(fetch({a}))").text("stderr") == "", "each refusal is named once"


def test_the_first_cells_starting_count_is_taken_before_the_cell_is_sent(
        kernelspec: str, engine: EngineEndpoint, servers: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """The count the first cell's refusals are named from is asked for once the sandbox has
    started, while the frontend has yet to send a cell: that cell does not wait for it (a
    round trip to a remote service). A refusal in that first cell is still named."""
    a, b = servers
    with proxied_engine(engine, monkeypatch) as proxy, \
            running_kernel(kernelspec, extra_arguments=[f"--SandboxKernel.egress=127.0.0.1:{a}"]) as (_, kc):
        def first(pattern: bytes) -> int | None:
            return next((i for i, line in enumerate(proxy.request_lines) if pattern in line), None)

        deadline = time.monotonic() + 60
        while first(b"/egress ") is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first(b"/egress ") is not None, "no count was taken before a cell came"
        assert first(b"/input ") is None, "no cell was sent yet"
        refused = execute(kc, FETCH + f"print(fetch({b}))")
        assert refused.text().startswith("HTTP 403")
        assert f"sandbox-kernel: egress refused {HOST_ALIAS}:{b}" in refused.text("stderr"), refused.outputs


def test_a_cell_without_refusals_costs_no_request(kernelspec: str, engine: EngineEndpoint, servers: tuple[int, int],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's stream says when the refusal count moved (ahead of the cell's output), so
    the kernel asks for the refusals only then: through a proxy that counts the requests (a
    remote engine, where each request is a round trip)."""
    a, b = servers
    with proxied_engine(engine, monkeypatch) as proxy, \
            running_kernel(kernelspec, extra_arguments=[f"--SandboxKernel.egress=127.0.0.1:{a}"]) as (_, kc):
        out(kc, FETCH)

        def egress_requests() -> int:
            return sum(line.startswith(b"GET ") and b"/egress " in line for line in proxy.request_lines)

        before = egress_requests()
        for _ in range(5):
            assert execute(kc, f"print(fetch({a}))").text("stderr") == ""
        assert egress_requests() == before, "no request for cells without refusals"
        refused = execute(kc, f"print(fetch({b}))")
        assert refused.text().startswith("HTTP 403")
        assert f"sandbox-kernel: egress refused {HOST_ALIAS}:{b}" in refused.text("stderr"), refused.outputs
        assert egress_requests() == before + 1


def test_the_rules_table_lines_up_and_status_shows_the_rules(kc: BlockingKernelClient,
                                                              servers: tuple[int, int]) -> None:
    a, b = servers
    out(kc, FETCH)
    out(kc, f"print(fetch({b}), fetch(9))")  # two refusals, destinations of different lengths
    shown = execute(kc, "%egress").of_type("display_data")[0]["data"]["text/plain"].splitlines()
    refusals = [line for line in shown if f"{HOST_ALIAS}:" in line][-2:]
    assert [line.split()[1] for line in refusals] == [f"{HOST_ALIAS}:{b}", f"{HOST_ALIAS}:9"]
    # each column starts at the same place on every line: label, destination, reason
    assert len({line.index(HOST_ALIAS) for line in refusals}) == 1, shown
    assert len({line.index("no rule allows") for line in refusals}) == 1, shown
    assert len({len(line) - len(line.split(None, 1)[1]) for line in (shown[0], shown[1], refusals[0])}) == 1, shown
    status = execute(kc, "%sandbox status").of_type("display_data")[0]["data"]["text/plain"]
    assert f"egress       only 127.0.0.1:{a}\n" in status, status


def test_a_preset_allows_a_package_index_and_narrowing_says_so(kc: BlockingKernelClient,
                                                                 servers: tuple[int, int]) -> None:
    a, _ = servers
    index = egress_rules.presets()["pypi"]
    out(kc, FETCH)
    try:
        out(kc, "%egress block-all")
        # a refused host of a preset is hinted as the preset: one allow, not one per failed install
        host, port = index[0].split(":")
        hinted = execute(kc, "import urllib.request\ntry:\n"
                             f"    urllib.request.urlopen('https://{host}:{port}/', timeout=10)\n"
                             "except OSError as exc:\n    print('refused:', exc)")
        assert hinted.text().startswith("refused:"), hinted.outputs  # it tried, through the proxy
        assert "sandbox-kernel: %egress allow pypi permits it" in hinted.text("stderr"), hinted.outputs
        out(kc, "%egress open")
        narrowed = out(kc, "%egress allow pypi")
        assert narrowed == (f"egress: only {', '.join(index)} (was: all public destinations; "
                            "every other destination is now refused)\n")
        widened = out(kc, f"%egress allow 127.0.0.1:{a}")  # adding to a list: no note
        assert widened == f"egress: only {', '.join(index)}, 127.0.0.1:{a}\n"
        assert out(kc, "%egress deny pypi") == f"egress: only 127.0.0.1:{a}\n"
    finally:
        out(kc, f"%egress only 127.0.0.1:{a}")


def test_bad_rules_are_refused_before_any_request(kc: BlockingKernelClient, servers: tuple[int, int]) -> None:
    a, _ = servers
    for line, message in (("%egress allow exa_mple..com", "invalid egress rule 'exa_mple..com'"),
                          ("%egress only 10.0.0.0/33", "invalid egress rule '10.0.0.0/33'"),
                          ("%egress deny 127.0.0.1:1", "not in the rules: 127.0.0.1:1"),
                          (f"%egress deny 127.0.0.1:{a}", "removing the last rule would allow")):
        result = execute(kc, line)
        assert result.reply["content"]["status"] == "error"
        [text] = result.text("stderr").splitlines()
        assert message in text
    assert f"only 127.0.0.1:{a}" in execute(kc, "%egress").of_type("display_data")[0]["data"]["text/plain"]


def test_the_engine_api_stays_closed(kc: BlockingKernelClient, engine: EngineEndpoint) -> None:
    port = int(engine.url.rsplit(":", 1)[1])
    out(kc, FETCH + f"\n%egress allow 127.0.0.1:{port}")
    assert "engine's API is never reachable" in out(kc, f"print(fetch({port}, detail=True))")


def test_api_validation_and_forks_with_their_own_rules(engine: EngineEndpoint, servers: tuple[int, int]) -> None:
    a, b = servers
    fetch = ("import urllib.request, sys\n"
             "try:\n    print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())\n"
             "except Exception as exc:\n    print(type(exc).__name__)")

    async def scenario() -> None:
        async with SandboxClient(engine.url, engine.token) as api:
            with pytest.raises(BadRequestError) as caught:
                await api.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-256mb", egress=["no spaces allowed"]))
            assert "invalid egress rule" in caught.value.user_message()
            parent = (await api.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-256mb",
                                                                    egress=[f"127.0.0.1:{a}"]))).id
            with pytest.raises(BadRequestError):
                await api.set_egress(parent, ["http://scheme.example"])
            assert (await api.get_egress(parent)).egress == [f"127.0.0.1:{a}"]

            async def reach(sandbox_id: str, port: int) -> str:
                result = await api.exec(sandbox_id, "python3", ["-c", fetch, f"http://{HOST_ALIAS}:{port}/"])
                return result.result.stdout.strip()

            await api.pause_sandbox(parent)
            await wait_status(api, parent, SandboxStatus.PAUSED)
            child = (await api.fork_sandbox(parent, ForkSandboxRequest(egress=[f"127.0.0.1:{b}"]))).id
            await wait_status(api, child, SandboxStatus.RUNNING, timeout=30)
            await api.resume_sandbox(parent)
            await wait_status(api, parent, SandboxStatus.RUNNING)
            assert (await reach(parent, a), await reach(parent, b)) == ("A", "HTTPError")
            assert (await reach(child, a), await reach(child, b)) == ("HTTPError", "B")
            for sandbox_id in (parent, child):
                await api.delete_sandbox(sandbox_id)

    asyncio.run(scenario())
