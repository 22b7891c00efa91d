"""The engine's client of a sandbox's agent (sandbox_kernel/local/agent_client.py) when the
agent is gone: a call racing its sandbox's destroy must fail as AgentUnavailable, which the
engine answers as 502 (or, on a stream, ends as the sandbox ending), never as a 500. And
when the agent is hostile: what it hands over is checked."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest

from sandbox_kernel.local.agent_client import AgentClient, AgentError, AgentUnavailable


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


def descriptors_of(target: str) -> int:
    """How many of this process's descriptors lead to `target` (as /proc names it)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") == target
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return count


@pytest.mark.parametrize("handed", ["a regular file", "a pipe's read end", "a socket", "nothing", "two"])
async def test_a_stdin_share_of_anything_but_a_pipe_write_end_is_refused(tmp_path: Path, handed: str) -> None:
    """A compromised agent answers the engine's stdin share (local/direct_input.py) with
    descriptors of its choosing, which the engine would then write a process's input into:
    anything but one pipe's write end is refused, and what came is closed, the connection too."""
    read_end, write_end = os.pipe()
    sockets = socket.socketpair()
    regular = os.open(tmp_path / "file", os.O_RDWR | os.O_CREAT)
    handing = {"a regular file": [regular], "a pipe's read end": [read_end], "a socket": [sockets[0].fileno()],
               "nothing": [], "two": [write_end, write_end]}[handed]
    targets = {os.readlink(f"/proc/self/fd/{fd}") for fd in handing}
    held = {target: descriptors_of(target) for target in targets}
    sent = []

    async def hostile(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readline()
        with socket.socket(fileno=os.dup(writer.get_extra_info("socket").fileno())) as raw:
            socket.send_fds(raw, [b'{"ok": true, "input_seq": 0}\n'], handing)
        sent.append(handed)
        await reader.read()

    server = await asyncio.start_unix_server(hostile, path=str(tmp_path / "agent.sock"))
    agent = AgentClient(tmp_path)
    try:
        with pytest.raises(AgentError):
            await agent.share_stdin("proc-1")
        assert {target: descriptors_of(target) for target in held} == held  # what came is closed
    finally:
        server.close()
        await server.wait_closed()
        for fd in (read_end, write_end, regular):
            os.close(fd)
        for end in sockets:
            end.close()
    assert sent == [handed]  # the agent did hand them over
    assert not agent.connections.open


async def test_a_stdin_share_of_a_pipe_write_end_is_taken(tmp_path: Path) -> None:
    """The other side of the check above: an agent's share of a pipe's write end is taken,
    non-blocking, with the agent's input_seq."""
    read_end, write_end = os.pipe()

    async def agent_side(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readline()
        with socket.socket(fileno=os.dup(writer.get_extra_info("socket").fileno())) as raw:
            socket.send_fds(raw, [b'{"ok": true, "input_seq": 7}\n'], [write_end])
        await reader.read()

    server = await asyncio.start_unix_server(agent_side, path=str(tmp_path / "agent.sock"))
    agent = AgentClient(tmp_path)
    try:
        fd, input_seq, (_, writer) = await agent.share_stdin("proc-1")
        assert input_seq == 7 and not os.get_blocking(fd)
        os.write(fd, b"through the engine's copy")
        assert os.read(read_end, 100) == b"through the engine's copy"
        os.close(fd)
        agent.hang_up(writer)
    finally:
        server.close()
        await server.wait_closed()
        os.close(read_end)
        os.close(write_end)
    assert not agent.connections.open
