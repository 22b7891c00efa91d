"""On CreateOS a pause or fork can take minutes. Interrupting a cell that waits for one
stops the wait with one clear line, keeps the kernel alive, and leaves the sandbox
consistent: the transition carries on in the service, and later cells see its result.

A proxy in front of the real engine makes the transition look endless: sandbox views say
"pausing" (or "forking") where the engine already says "paused" (or "running").
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from jupyter_client import BlockingKernelClient, KernelManager

from fault_proxy import FaultProxy, proxied_engine
from kernel_helpers import TIMEOUT, execute, running_kernel
from sandbox_kernel.local.service import EngineEndpoint

pytestmark = pytest.mark.slow


@pytest.fixture
def slow_service(kernelspec: str, engine: EngineEndpoint, monkeypatch: pytest.MonkeyPatch
                 ) -> Iterator[tuple[FaultProxy, KernelManager, BlockingKernelClient]]:
    with proxied_engine(engine, monkeypatch) as proxy:
        with running_kernel(kernelspec) as (km, kc):
            execute(kc, "state = 'kept'")
            yield proxy, km, kc


def shown(kc: BlockingKernelClient, magic: str) -> str:
    [display] = execute(kc, magic).of_type("display_data")
    return display["data"]["text/plain"]


def drain(kc: BlockingKernelClient) -> list[dict]:
    """Shell replies that have arrived so far."""
    replies = []
    while kc.shell_channel.msg_ready():
        replies.append(kc.get_shell_msg(timeout=1))
    return replies


def interrupted_cell(km: KernelManager, kc: BlockingKernelClient, code: str, proxy: FaultProxy) -> dict:
    """Run code, interrupt it once it has polled a held status a few times; its reply."""
    msg_id = kc.execute(code)
    deadline = time.monotonic() + TIMEOUT
    while proxy.held_views < 3:
        assert time.monotonic() < deadline, "the cell never waited on the held status"
        ended = [m for m in drain(kc) if m["parent_header"].get("msg_id") == msg_id]
        assert not ended, f"the cell ended before it was interrupted: {ended[0]['content']}"
        time.sleep(0.05)
    km.interrupt_kernel()
    while True:
        reply = kc.get_shell_msg(timeout=TIMEOUT)
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply["content"]


def test_interrupting_a_long_pause_stops_the_wait_and_the_sandbox_stays_usable(
        slow_service: tuple[FaultProxy, KernelManager, BlockingKernelClient]) -> None:
    proxy, km, kc = slow_service
    proxy.hold_status = ("paused", "pausing")
    reply = interrupted_cell(km, kc, "%sandbox pause", proxy)
    assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt"
    assert "stopped waiting" in reply["evalue"]
    proxy.hold_status = None
    assert "state        paused" in shown(kc, "%sandbox status")
    # The next cell resumes the paused sandbox, and its state is all there.
    assert execute(kc, "print(state)").text() == "kept\n"


def test_interrupting_a_long_fork_leaves_the_fork_listed_and_the_notebook_where_it_was(
        slow_service: tuple[FaultProxy, KernelManager, BlockingKernelClient]) -> None:
    proxy, km, kc = slow_service
    before = shown(kc, "%sandbox list")
    proxy.hold_status = ("running", "forking")
    reply = interrupted_cell(km, kc, "%sandbox fork --switch", proxy)
    assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt"
    proxy.hold_status = None
    after = shown(kc, "%sandbox list")
    assert len(after.splitlines()) == len(before.splitlines()) + 1, "the fork exists and is listed"
    # Not switched: cells still run in the (resumed) source sandbox.
    assert execute(kc, "print(state)").text() == "kept\n"
    assert execute(kc, "state = 'changed'; print(state)").text() == "changed\n"
