"""Managed processes (CreateOS §15.3) on the local engine: a thin proxy to the sandbox's agent.

The process table and each process's retained output live in the agent, inside the
sandbox (guest/processes.py holds the details): they survive an engine restart and the
memory they take is the sandbox's. This module adds only what must happen outside:
HTTP status mapping, heartbeats on idle streams, the end of a stream whose sandbox went
away, and input written into a pipe the agent shares (direct_input.py, where the agent
still keeps the count). Semantics a client (the kernel) can rely on:

- create: pipes, or a PTY with `pty: {rows, cols}` (24x80 by default; without `cmd`, a
  shell). Per-process `env` is added to the sandbox's envs and wins; `cwd` defaults to
  /workspace. A command that cannot start answers 400.
- Output frames are numbered from 1 per process; each process retains its newest
  8 MiB of output (guest/processes.py WINDOW_BYTES; each chunk is also charged 128 bytes,
  so tiny chunks cannot outgrow it). `connect?after=N` replays retained frames with
  seq > N, then follows live output, then sends `exit` (seq = last data seq) and ends.
  `exit` falls due when the leader has exited and its output ended or its tree is gone.
  The first frame after a gap (after=N older than the window, or a reader slower than
  the process) carries `oldest_available_seq`. Heartbeats (`{"type": "heartbeat"}`)
  every 5 s of silence, also while the sandbox is paused. A stream whose sandbox ends
  first gets one `error` frame and ends.
- Disconnecting never affects the process. Several connects may follow one process.
- input: bytes to stdin (PTY: keystrokes), serialized, answered `{input_seq}` (1, 2, ...)
  once written to the pipe (it waits while the pipe is full); 409 after the leader
  exited or stdin was closed. A pipe process's input is written by the engine itself
  from its first on (the agent shares the pipe: direct_input.py).
- kill (`grace_ms`): SIGTERM to the tree (the leader's session), SIGKILL after the grace
  (at once without); answered once the tree is gone. signal: to the leader's process
  group (PTY: to the terminal's foreground job). wait: `scope=leader|tree`, `timeout_ms`
  (answers the process as it is when the time runs out).
- list: live and exited processes; at most 32 per sandbox (the oldest exited ones make
  room; 409 when all 32 still run), so the sandbox holds at most ~260 MiB of output.
- Every request needs the sandbox running (409 otherwise: a paused agent cannot answer).
  Pause freezes the processes with the sandbox; open streams stay open (heartbeats) and
  carry on at resume. Destroy ends them. A fork starts with an empty table: the source's
  processes stay in the source. A fork-aware process (the runner) that is a managed
  process still follows the fork, but its copy is not a managed process of the fork: it
  keeps the descriptors it had (the source's pipes) and must reopen its stdio there.
  The copy is outside the source's trees and signals (they stop at the mount namespace).
- Activity for auto-pause: every request but connect, get, list and wait, and output
  passing through a connect. An open connect alone is not (a kernel holds one for its
  lifetime), nor is a process running silently.
- Refusals carry JSend codes `process_not_found` (404), `process_invalid` (400) and
  `process_conflict` (409), so a 404 for a missing process is told apart from a provider
  without the route.
- State `failed` is never used: a command that cannot start answers 400 instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator

from sandbox_kernel.local.agent_client import AgentError, AgentUnavailable
from sandbox_kernel.local.engine import HEARTBEAT_SECONDS, Engine
from sandbox_kernel.local.engine_errors import Conflict, EngineError, InvalidRequest, NotFound
from sandbox_kernel.local.local_sandbox import LocalSandbox

HEARTBEAT = b'{"type":"heartbeat"}\n'
# How the agent's frames begin (guest/agent.py writes compact JSON, "type" first): told by
# their prefix, as parsing each frame (up to ~350 KiB) only for its type cost the engine more
# than passing it on. A frame a compromised agent mislabels only misleads auto-pause.
DATA_FRAME, EXIT_FRAME = b'{"type":"data"', b'{"type":"exit"'
# Frames read from the agent ahead of a slow HTTP client: each is at most ~350 KiB (a
# 256 KiB read, guest/processes.py READ_CHUNK, in base64), so about 1 MiB per stream.
FRAMES_IN_FLIGHT = 3
PASSIVE = frozenset({"get", "list", "wait", "connect"})  # not activity for auto-pause
ERRORS: dict[str, type[EngineError]] = {"not_found": NotFound, "invalid": InvalidRequest, "conflict": Conflict}


class ProcessFailed(EngineError):
    status = 500


def _sandbox(engine: Engine, sandbox_id: str, op: str) -> LocalSandbox:
    """The sandbox, which must be running: a paused one's agent is frozen and cannot answer."""
    sandbox = engine.running(sandbox_id)
    if op not in PASSIVE:
        sandbox.touch()
    return sandbox


def _engine_error(exc: AgentError) -> EngineError:
    return ERRORS.get(exc.code, ProcessFailed)(str(exc), code="process_" + exc.code)


@contextlib.contextmanager
def _refusals_answered() -> Iterator[None]:
    """The agent's refusals as the engine answers them."""
    try:
        yield
    except AgentError as exc:
        raise _engine_error(exc) from None


async def call(engine: Engine, sandbox_id: str, op: str, **fields: object) -> dict:
    """Run one managed-process op in the sandbox's agent; its answer without the `ok`."""
    sandbox = _sandbox(engine, sandbox_id, op)
    with _refusals_answered():
        reply = await sandbox.agent.process_call(op, **fields)
    reply.pop("ok", None)
    return reply


async def write_input(engine: Engine, sandbox_id: str, process_id: str, data: bytes) -> dict:
    """Input to a process's stdin: {"input_seq": N}. Written by the engine itself once the
    agent shares a pipe process's stdin (direct_input.py), else by the agent."""
    sandbox = _sandbox(engine, sandbox_id, "input")
    with _refusals_answered():
        return {"input_seq": await sandbox.direct_input.write(sandbox.agent, process_id, data)}


async def close_stdin(engine: Engine, sandbox_id: str, process_id: str) -> None:
    sandbox = _sandbox(engine, sandbox_id, "stdin_close")
    with _refusals_answered():
        await sandbox.direct_input.close_stdin(sandbox.agent, process_id)


def _refusals(sandbox: LocalSandbox) -> int:
    proxy = sandbox.gate.proxy if sandbox.gate else None
    return proxy.denied_count if proxy else 0


def _refusals_frame(count: int) -> bytes:
    """A heartbeat carrying how many connections the sandbox's egress rules refused so far,
    sent when that moved since the stream opened or last said it (a local engine extension,
    which clients ignore): the kernel learns of a cell's refusals ahead of its output,
    without asking after every cell. The proxy counts a refusal before it answers it, so
    output the refused client printed after it comes after this frame. (A count that moved
    while no stream was open is told with the next move.)"""
    return (json.dumps({"type": "heartbeat", "egress_denied_count": count}) + "\n").encode()


async def connect(engine: Engine, sandbox_id: str, process_id: str, after: int) -> AsyncIterator[bytes]:
    """The NDJSON lines of `connect?after=N`. Raises NotFound (etc.) before the first line,
    so the route can still answer an HTTP error; the stream is opened here."""
    sandbox = _sandbox(engine, sandbox_id, "connect")
    opened = contextlib.AsyncExitStack()
    try:
        frames = await opened.enter_async_context(sandbox.agent.process_connect(process_id, after))
    except AgentError as exc:
        await opened.aclose()
        raise _engine_error(exc) from None
    return _relay(sandbox, frames, opened)


async def _relay(sandbox: LocalSandbox, frames: AsyncIterator[bytes],
                 opened: contextlib.AsyncExitStack) -> AsyncIterator[bytes]:
    """Pass the agent's frames on, with heartbeats in silences and an error frame if the
    sandbox ends before the process does. At most FRAMES_IN_FLIGHT wait for the client.
    Output passing through is activity (auto-pause), the stream's mere existence is not."""
    queue: asyncio.Queue[bytes | None] = asyncio.Queue(FRAMES_IN_FLIGHT)

    async def pump() -> None:
        try:
            async for line in frames:
                await queue.put(line)
        except (AgentUnavailable, ConnectionError):
            pass
        finally:
            await queue.put(None)

    task = asyncio.get_running_loop().create_task(pump())
    ended = False
    refused = _refusals(sandbox)
    try:
        while True:
            try:
                line = queue.get_nowait()
            except asyncio.QueueEmpty:
                try:  # (asyncio.timeout: wait_for ran each get as a task of its own, a loop turn more per frame)
                    async with asyncio.timeout(HEARTBEAT_SECONDS):
                        line = await queue.get()
                except TimeoutError:
                    yield HEARTBEAT
                    continue
            if line is None:
                break
            ended = line.startswith(EXIT_FRAME)
            if line.startswith(DATA_FRAME):
                sandbox.touch()
                now = _refusals(sandbox)
                if now != refused:  # before the output that came after them
                    refused = now
                    yield _refusals_frame(refused)
            yield line
        if not ended:
            yield (json.dumps({"type": "error", "error": "the sandbox ended before the process did"})
                   + "\n").encode()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        await opened.aclose()
