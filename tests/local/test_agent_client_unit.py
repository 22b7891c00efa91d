"""The engine's client of a sandbox's agent (sandbox_kernel/local/agent_client.py) when the
agent is gone: a call racing its sandbox's destroy must fail as AgentUnavailable, which the
engine answers as 502 (or, on a stream, ends as the sandbox ending), never as a 500."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from sandbox_kernel.local.agent_client import AgentClient, AgentUnavailable


async def test_a_removed_sandbox_dir_is_an_unavailable_agent(tmp_path: Path) -> None:
    agent = AgentClient(tmp_path / "destroyed-sandbox")
    with pytest.raises(AgentUnavailable):
        await agent.process_call("get", id="proc-1")
    with pytest.raises(AgentUnavailable):
        async with agent.process_connect("proc-1", 0):
            pass


async def test_an_agent_that_hangs_up_at_once_is_unavailable(tmp_path: Path) -> None:
    """Accepts, then closes with the request unread (its sandbox ending): the reset or the
    early end of the answer is the agent being unavailable, whichever way it shows."""
    hung_up = 0

    async def hang_up(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal hung_up
        hung_up += 1
        writer.transport.abort()  # RST where the kernel allows it: the harshest ending

    server = await asyncio.start_unix_server(hang_up, path=str(tmp_path / "agent.sock"))
    agent = AgentClient(tmp_path)
    try:
        with pytest.raises(AgentUnavailable):
            async with agent.process_connect("proc-1", 0):
                pass
        with pytest.raises(AgentUnavailable):
            await agent.process_call("get", id="proc-1")
    finally:
        server.close()
        await server.wait_closed()
    assert hung_up == 2  # both reached the (vanishing) agent
    assert not agent.connections.open  # and left no connection behind
