"""Input the engine writes into a managed process's stdin itself.

A cell reaches the runner as `input` to its relay's stdin. Passed through the sandbox's agent,
that woke one process more on every cell's way in: the engine woke the agent, which woke to
write the pipe (0.5 ms of a cell's first output after an idle moment, docs/performance.md).
So at a pipe process's first input the agent shares the write end of its stdin with the
engine (agent.py, process_stdin_share), and the engine writes that input and every later one
itself.

The agent keeps the process's state. The engine tells it the process's input_seq on the
share's connection, a few milliseconds after its writes (at once, the agent woke as the
process it had just fed did, and took the CPU from it: the cell's way in was as slow as
through the agent) and when the share ends, and the agent's count goes on from there (an
engine that takes over shares again from the agent's count; one killed within those
milliseconds of a write leaves it behind by that write). The agent hangs up the share when
the leader exits; input then goes through the agent again, which refuses it (409) as before.
Every input to a process is serialized here, whichever way it goes, so the engine never
writes through both at once.

What the sandbox hands over is untrusted: only a pipe's write end is taken (agent_client.py),
writes never block the engine (it waits for room as the agent did), and a share whose agent
stops reading the reports is given up.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass, field

from sandbox_kernel.local.agent_client import AgentClient, AgentError

# Unread reports (a few bytes each) an agent may leave before its share is given up.
REPORTS_BACKLOG = 64 * 1024
# Seconds from a write to its report: the reader (the runner, given a cell) has the CPU
# to itself meanwhile.
REPORT_DELAY = 0.005
# Processes whose input is tracked per sandbox; past it, those without a share and with no
# input under way are forgotten (the agent keeps at most 32 processes).
MAX_TRACKED = 64
PIPE_CHUNK = 64 * 1024  # bytes written at a time


@dataclass
class _ProcessInput:
    """One process's input: its order, and its stdin's write end when shared."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    shareable: bool = True  # cleared once the agent refuses or a share ends
    fd: int | None = None
    input_seq: int = 0
    agent: AgentClient | None = None
    reports: asyncio.StreamWriter | None = None
    report_due: asyncio.TimerHandle | None = None
    watch: asyncio.Task[None] | None = None


class DirectInput:
    """One sandbox's processes' input (LocalSandbox.direct_input)."""

    def __init__(self) -> None:
        self._processes: dict[str, _ProcessInput] = {}
        self._ending: set[asyncio.Task[None]] = set()  # shares ended once their write is done

    async def write(self, agent: AgentClient, process_id: str, data: bytes) -> int:
        """Write `data` to the process's stdin, whole, after any earlier input; its input_seq.
        AgentError as the agent would refuse it (not_found, conflict...)."""
        process = self._tracked(process_id)
        async with process.lock:
            if process.fd is None and process.shareable:
                await self._share(agent, process_id, process)
            if process.fd is None:
                return int((await agent.process_call("input", data, id=process_id))["input_seq"])
            return await self._write_shared(process, data)

    async def close_stdin(self, agent: AgentClient, process_id: str) -> None:
        """Close the process's stdin (after the input written before): the engine's copy,
        then the agent's."""
        process = self._processes.get(process_id)
        if process is None:
            await agent.process_call("stdin_close", id=process_id)
            return
        async with process.lock:
            self._end(process)
            await agent.process_call("stdin_close", id=process_id)

    def close(self) -> None:
        """End every share (the sandbox is destroyed, or the engine stops); one a write waits
        on (a full pipe) once that write has failed or gone through."""
        for process in self._processes.values():
            self._end_soon(process)
        self._processes.clear()

    def _tracked(self, process_id: str) -> _ProcessInput:
        process = self._processes.get(process_id)
        if process is None:
            if len(self._processes) >= MAX_TRACKED:
                for known, entry in list(self._processes.items()):
                    if entry.fd is None and not entry.lock.locked():
                        del self._processes[known]
            process = self._processes[process_id] = _ProcessInput()
        return process

    async def _share(self, agent: AgentClient, process_id: str, process: _ProcessInput) -> None:
        try:
            fd, input_seq, (reader, writer) = await agent.share_stdin(process_id)
        except AgentError as exc:
            # A refusal stands (a pty, an exited process...), but for a share an engine
            # that ended just now still holds: the agent reads its end in a moment.
            process.shareable = exc.code == "busy"
            return
        process.shareable = False  # one share per process: once it ends, input goes by the agent
        process.fd, process.input_seq, process.agent, process.reports = fd, input_seq, agent, writer
        process.watch = asyncio.ensure_future(self._until_hung_up(process, reader))

    async def _until_hung_up(self, process: _ProcessInput, reader: asyncio.StreamReader) -> None:
        """The agent sends nothing on a share: its end, or anything it sends, ends it."""
        with contextlib.suppress(ConnectionError):
            await reader.read(1)
        await self._end_after_writes(process)

    async def _end_after_writes(self, process: _ProcessInput) -> None:
        async with process.lock:  # its descriptor is not closed under a write waiting on it
            self._end(process)

    def _end_soon(self, process: _ProcessInput) -> None:
        """End the share now, or once the write that waits on its pipe has ended."""
        if process.fd is None or not process.lock.locked():
            self._end(process)
            return
        ending = asyncio.ensure_future(self._end_after_writes(process))
        self._ending.add(ending)
        ending.add_done_callback(self._ending.discard)

    async def _write_shared(self, process: _ProcessInput, data: bytes) -> int:
        assert process.fd is not None
        process.input_seq += 1  # counted as the agent counts: a write that fails takes its number
        if process.report_due is None:
            process.report_due = asyncio.get_running_loop().call_later(REPORT_DELAY, self._report, process)
        try:
            await _write_whole(process.fd, data)
        except OSError as exc:  # no reader left (the process and its tree are gone)
            raise AgentError("conflict", f"stdin: {exc.strerror or exc}") from None
        return process.input_seq

    def _report(self, process: _ProcessInput) -> None:
        """Tell the agent the process's input_seq."""
        process.report_due = None
        if process.reports is None:
            return
        process.reports.write(b"%d\n" % process.input_seq)
        if process.reports.transport.get_write_buffer_size() > REPORTS_BACKLOG:
            self._end_soon(process)  # the agent does not read them: its count would fall behind

    @staticmethod
    def _end(process: _ProcessInput) -> None:
        """Give the share up (if any): close the engine's copy and hang up, which the
        agent takes as its end."""
        process.shareable = False
        if process.fd is not None:
            os.close(process.fd)
            process.fd = None
        if process.report_due is not None:
            process.report_due.cancel()
            process.report_due = None
        if process.agent is not None and process.reports is not None:
            process.reports.write(b"%d\n" % process.input_seq)  # the count so far, before the end
            process.agent.hang_up(process.reports)
        process.reports = None
        if process.watch is not None and process.watch is not asyncio.current_task():
            process.watch.cancel()
        process.watch = None


async def _write_whole(fd: int, data: bytes) -> None:
    """Write all of `data` to the non-blocking pipe `fd`, waiting while it is full."""
    loop = asyncio.get_running_loop()
    written = 0
    while written < len(data):
        try:
            written += os.write(fd, data[written:written + PIPE_CHUNK])
        except BlockingIOError:
            room = loop.create_future()
            loop.add_writer(fd, lambda: room.done() or room.set_result(None))
            try:
                await room
            finally:
                loop.remove_writer(fd)
