"""Every execute_request gets its reply, whatever state the kernel is in: a cell that comes
while the kernel shuts down (its sandbox being destroyed, or its start being given up) is
answered with one line, and the kernel still exits by itself (not killed).

The proxy in front of the real engine makes the shutdown last as long as the test needs: it
holds the sandbox's destruction, or the sandbox's creation (the start the shutdown gives up).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from jupyter_client import BlockingKernelClient, KernelManager

from engine_helpers import sandbox_status
from fault_proxy import FaultProxy, proxied_engine
from kernel_helpers import TIMEOUT, execute
from message_spec import validate
from sandbox_kernel.api import SandboxStatus
from sandbox_kernel.local.service import EngineEndpoint

pytestmark = pytest.mark.slow

# Long enough for the kernel to end on its own under load, however slow: a kernel that
# jupyter_client has to terminate or kill ends with another code than 0.
SHUTDOWN_WAIT = 60.0
SHUTTING_DOWN = "sandbox-kernel: the kernel is shutting down: the cell did not run\n"


@pytest.fixture
def started(kernelspec: str, engine: EngineEndpoint, monkeypatch: pytest.MonkeyPatch,
            request: pytest.FixtureRequest) -> Iterator[tuple[FaultProxy, KernelManager, BlockingKernelClient]]:
    """A kernel behind the proxy (with the faults the test gives as parameter), its IOPub subscribed."""
    with proxied_engine(engine, monkeypatch, **request.param) as proxy:
        km = KernelManager(kernel_name=kernelspec, shutdown_wait_time=SHUTDOWN_WAIT)
        km.start_kernel()
        kc = km.client()
        kc.start_channels()
        try:
            while kc.get_iopub_msg(timeout=TIMEOUT)["msg_type"] != "iopub_welcome":
                pass  # the kernel's IOPub heard our subscription: nothing it says from now on is lost
            yield proxy, km, kc
        finally:
            proxy.hold_deletes = False
            kc.stop_channels()
            if km.is_alive():
                km.shutdown_kernel(now=True)


def until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def handled(kc: BlockingKernelClient, msg_id: str) -> None:
    """Until the kernel announces it is handling the request (its execute_input)."""
    while True:
        msg = kc.get_iopub_msg(timeout=TIMEOUT)
        if msg["msg_type"] == "execute_input" and msg["parent_header"].get("msg_id") == msg_id:
            return


def answer(kc: BlockingKernelClient, msg_id: str) -> tuple[dict[str, Any], str]:
    """The request's execute_reply, and what the cell showed on stderr until it went idle."""
    while True:
        reply = kc.get_shell_msg(timeout=TIMEOUT)
        if reply["parent_header"].get("msg_id") == msg_id:
            break
    validate(reply)
    stderr = ""
    while True:
        msg = kc.get_iopub_msg(timeout=TIMEOUT)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        validate(msg)
        if msg["msg_type"] == "stream" and msg["content"]["name"] == "stderr":
            stderr += msg["content"]["text"]
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return reply, stderr


def exits_by_itself(km: KernelManager) -> int | None:
    """Wait for the kernel process to end; its exit code (0: it ended on its own)."""
    process = km.provisioner.process
    km.finish_shutdown(waittime=SHUTDOWN_WAIT)
    return process.returncode


@pytest.mark.parametrize("started", [{"hold_creates": True}], indirect=True)
def test_a_cell_waiting_for_a_start_that_shutdown_gives_up_is_answered(
        started: tuple[FaultProxy, KernelManager, BlockingKernelClient], engine: EngineEndpoint) -> None:
    proxy, km, kc = started
    until(lambda: proxy.held_creates, "the kernel never created its sandbox")
    msg_id = kc.execute("print('never runs')")
    handled(kc, msg_id)  # the cell waits for the sandbox, which never comes
    km.request_shutdown()  # which gives the start up (cancels it) after a short wait
    reply, stderr = answer(kc, msg_id)
    assert reply["content"]["status"] == "error"
    assert stderr == SHUTTING_DOWN
    assert exits_by_itself(km) == 0
    [held] = proxy.held_creates
    assert sandbox_status(engine, held) in (SandboxStatus.DESTROYED, None)


@pytest.mark.parametrize("started", [{}], indirect=True)
def test_a_cell_sent_while_the_kernel_shuts_down_is_answered(
        started: tuple[FaultProxy, KernelManager, BlockingKernelClient], engine: EngineEndpoint) -> None:
    proxy, km, kc = started
    sandbox_id = execute(kc, "import os; print(os.environ['SANDBOX_ID'])").text().strip()
    proxy.hold_deletes = True
    km.request_shutdown()
    until(lambda: proxy.held_deletes, "the kernel never destroyed its sandbox")
    msg_id = kc.execute("print('ran')")  # the shutdown is under way: its sandbox is being destroyed
    reply, stderr = answer(kc, msg_id)
    assert reply["content"]["status"] == "error"
    assert stderr == SHUTTING_DOWN
    proxy.hold_deletes = False
    assert exits_by_itself(km) == 0
    assert sandbox_status(engine, sandbox_id) in (SandboxStatus.DESTROYED, None)
