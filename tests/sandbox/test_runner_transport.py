"""The one seam to the runner (sandbox/transport.py): the channel and the exec fallback, each
driven only as a RunnerTransport, reach the same runner daemon in a real sandbox of the
local engine, and once that runner is gone both say so the same way: RunnerTransportError
with runner_gone, whichever of them carried the cell that killed it."""

from __future__ import annotations

from typing import Any

import pytest

from sandbox_kernel.config import Settings, open_client
from sandbox_kernel.guest import protocol
from sandbox_kernel.local.service import EngineEndpoint
from sandbox_kernel.sandbox.exec_transport import ExecStreaming
from sandbox_kernel.sandbox.runner_link import channel_to, execs_to
from sandbox_kernel.sandbox.session import SandboxSession
from sandbox_kernel.sandbox.transport import RunnerTransport, RunnerTransportError

pytestmark = pytest.mark.slow

LINE_LIMIT = 8 * 2**20
KILL_ITSELF = "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)"


class Cells:
    """Runs cells through a transport, as the session builds their requests."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.count = 0

    async def run(self, transport: RunnerTransport, code: str) -> tuple[dict[str, Any], str]:
        """The cell's done event and its stdout."""
        self.count += 1
        cell_id = f"seam-{self.count}"
        printed: list[str] = []

        async def on_event(event: dict[str, Any]) -> None:
            if event.get(protocol.TYPE) == protocol.STREAM and event.get("name") == "stdout":
                printed.append(event["text"])
        request = {protocol.CELL_ID: cell_id, "code": code, "silent": False, "store_history": True,
                   "output_limit": self.settings.output_limit, "output_rate": self.settings.output_rate}
        done = await transport.run_cell(cell_id, request, on_event)
        return done, "".join(printed)


async def _no_background(event: dict[str, Any]) -> None:
    raise AssertionError(f"no output between cells was expected: {event}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("killed_through", ["channel", "execs"])
async def test_both_transports_reach_one_runner_and_say_its_death_the_same_way(
        engine: EngineEndpoint, killed_through: str) -> None:
    settings = Settings.from_env()
    # A real sandbox with its runner serving; the session opens no transport of its own
    # (and closes the client at its shutdown).
    client = await open_client(settings)
    session = SandboxSession(settings, client=client, open_channel=False, refill_pool=False)
    await session.start()
    assert session.sandbox_id is not None
    channel = channel_to(client, session.sandbox_id, LINE_LIMIT, _no_background)
    try:
        await channel.open()
        transports: dict[str, RunnerTransport] = {
            "channel": channel, "execs": execs_to(client, session.sandbox_id, LINE_LIMIT, ExecStreaming())}
        cells = Cells(settings)

        # One runner behind both: a variable set through one is read through the other.
        done, printed = await cells.run(transports["channel"], "x = 41 + 1\nprint('set')")
        assert (done["status"], printed) == ("ok", "set\n")
        done, printed = await cells.run(transports["execs"], "print(x)")
        assert (done["status"], printed) == ("ok", "42\n")
        for transport in transports.values():
            info = await transport.request({protocol.OP: protocol.INFO})
            assert info["python_version"] == session.runner_info["python_version"]

        # The cell that kills the runner, then a cell through each: the same error every time.
        failures = []
        for name in (killed_through, *transports):
            with pytest.raises(RunnerTransportError) as failure:
                await cells.run(transports[name], KILL_ITSELF if not failures else "print('never')")
            failures.append(failure.value)
        assert all(failure.runner_gone for failure in failures), [str(failure) for failure in failures]
        # The channel is over for good; the exec transport has nothing that ends.
        assert channel.failure is not None and channel.failure.runner_gone
        assert transports["execs"].failure is None
    finally:
        await channel.close()
        await session.shutdown()
