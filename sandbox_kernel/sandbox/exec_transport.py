"""The fallback transport to the runner: one exec of its light client per request.

Used on providers without managed processes (channel.py is the transport everywhere
else; runner_link.py decides which, once, at the first runner start). Each cell is one
streaming exec of `guest/runner/client.py run`, whose stdout is the cell's NDJSON events. If that stream
drops, `run` is sent again with the last event seen, and the runner resumes the same cell
from there, so nothing is lost or repeated. Where the service cannot stream exec output
(some CreateOS versions: 404 or an `error` frame; a gateway answering a held exec with
502), cells are followed by polling instead: short buffered execs, each returning the
cell's new events.

Bounds: the runner client's stdout is sandbox-controlled. Lines are cut with
BoundedLines (an unterminated line is counted, never held) and its stderr is kept only
as a short tail.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sandbox_kernel.api import BoundedLines, NotFoundError, OversizedLine, SandboxClient, ServerError
from sandbox_kernel.guest import protocol
from sandbox_kernel.sandbox.event_lines import parse_event_line
from sandbox_kernel.sandbox.transport import RECONNECT_DELAYS, RECOVERABLE, EventHandler, RunnerTransportError

log = logging.getLogger("sandbox_kernel.sandbox.exec_transport")

# The runner client's arguments for a command and its base64 JSON argument.
ClientArgs = Callable[[str, str], list[str]]

# Without streaming exec, each buffered exec returns a cell's new events after at most this.
POLL_WAIT = 1.0
# A gateway in front of CreateOS that answers a held streaming exec with one of these will
# do so again: follow cells by polling instead. Streams that drop this many times in a row
# without new output are given up on the same way.
GATEWAY_GAVE_UP = (502, 504)
STREAM_DROPS_BEFORE_POLLING = 2
CLIENT_FAILURES_BEFORE_GIVING_UP = 3
STDERR_TAIL = 4096  # of the runner client's stderr, kept for its last words


class StreamingUnavailable(Exception):
    """The sandbox service cannot stream exec output (CreateOS: 404, or an `error` frame)."""


def encode_arg(message: dict[str, Any]) -> str:
    """A request as the runner client's argument: base64 of its JSON (no quoting problems)."""
    return base64.b64encode(json.dumps(message).encode()).decode()


def runner_failed(output: str) -> RunnerTransportError:
    return RunnerTransportError("the Python runner in the sandbox failed: "
                                + (output.strip().splitlines() or ["no output"])[-1])


@dataclass
class ExecStreaming:
    """Whether the sandbox service streams exec output: learnt once per session and kept
    across its sandboxes. Streaming exec is the fast path; some CreateOS versions lack it,
    then cells are followed by polling the runner with short buffered execs."""

    available: bool = True


class ExecTransport:
    """Runs cells and requests in one sandbox by execs of the runner client; see the module
    docstring. A RunnerTransport (transport.py)."""

    # Each request is an exec of its own: nothing to lose for good, nothing to end.
    failure: RunnerTransportError | None = None

    def __init__(self, client: SandboxClient, sandbox_id: str, python: str, client_args: ClientArgs,
                 line_limit: int, streaming: ExecStreaming) -> None:
        self.client = client
        self.sandbox_id = sandbox_id
        self.python = python
        self.client_args = client_args
        self.line_limit = line_limit
        self.streaming = streaming

    async def run_cell(self, cell_id: str, request: dict[str, Any], on_event: EventHandler,
                       on_sent: Callable[[], None] | None = None) -> dict[str, Any]:
        """Run one cell, delivering its events in order; return its done event. An exec carries
        the request and the events together, so nothing says earlier that the runner has the
        cell: on_sent is not called.

        RunnerTransportError: the runner died (runner_gone), or the cell could not be followed.
        """
        stream = _EventStream(self, on_event)
        done = await self._follow(stream, request)
        failures = 0
        while done is None:
            if stream.broken:  # a dropped or failed exec: try again, a bounded number of times
                if failures == len(RECONNECT_DELAYS):
                    raise RunnerTransportError("lost the connection to the sandbox while a cell was running; "
                                     "its output so far is shown above")
                if self.streaming.available and failures + 1 >= STREAM_DROPS_BEFORE_POLLING:
                    log.warning("exec streams keep dropping with no new output: following cells by polling")
                    self.streaming.available = False
                await asyncio.sleep(RECONNECT_DELAYS[failures])
                failures += 1
            progress = stream.last_seq
            # "run" again: the runner knows the cell by its id, so a run that did reach it
            # is only followed, and one lost on the way (a gateway answering 502 before
            # forwarding) is started now instead of reported unknown.
            done = await self._follow(stream, {**request, protocol.AFTER: stream.last_seq})
            if stream.last_seq > progress:
                failures = 0
        return done

    async def _follow(self, stream: _EventStream, request: dict[str, Any]) -> dict[str, Any] | None:
        """One exec of `guest/runner/client.py run`: streamed if the service can, else one poll."""
        if self.streaming.available:
            try:
                return await stream.follow(self.client_args(protocol.RUN, encode_arg({**request, "wait": None})))
            except StreamingUnavailable as exc:
                log.warning("streaming exec unavailable (%s): following cells by polling", exc)
                self.streaming.available = False
        return await stream.poll(self.client_args(protocol.RUN, encode_arg({**request, "wait": POLL_WAIT})))

    async def request(self, message: dict[str, Any]) -> dict[str, Any]:
        """A runner request by one exec of its light client; its answer (the client's
        {"error": ...} if the daemon is gone), RunnerTransportError if there is none."""
        response = await self.client.exec(self.sandbox_id, self.python,
                                          self.client_args("request", encode_arg(message)))
        lines = response.result.stdout.strip().splitlines()
        try:
            answer = json.loads(lines[-1]) if lines else None
        except ValueError:  # the sandbox's code can replace the client
            answer = None
        if not isinstance(answer, dict):
            raise RunnerTransportError("its client gave no answer")
        return answer

    async def send(self, message: dict[str, Any]) -> None:
        await self.request(message)

    async def close(self, kill: bool = True) -> bool:
        return True  # nothing of ours runs in the sandbox between requests


class _EventStream:
    """Reads one cell's events over successive execs, skipping any already delivered (by seq)."""

    def __init__(self, transport: ExecTransport, on_event: EventHandler) -> None:
        self.transport = transport
        self.client = transport.client
        self.sandbox_id = transport.sandbox_id
        self.on_event = on_event
        self.line_limit = transport.line_limit
        self.last_seq = 0
        self.broken = False  # did the last exec fail (rather than end or time out)?
        self.client_failures = 0  # runner clients that failed in a row

    async def follow(self, runner_args: list[str]) -> dict[str, Any] | None:
        """Deliver new events until `done` (returned) or the stream breaks (None)."""
        lines = BoundedLines(self.line_limit)
        stderr = ""
        seen_output = False
        self.broken = True
        try:
            async with self.client.exec_stream(self.sandbox_id, self.transport.python, runner_args) as frames:
                async for frame in frames:
                    if frame.stderr:
                        stderr = (stderr + frame.stderr)[-STDERR_TAIL:]
                    if frame.error:
                        if not seen_output:  # the command never ran: the service cannot stream
                            raise StreamingUnavailable(f"error frame: {frame.error}")
                        log.warning("exec stream error frame: %s", frame.error)
                        return None
                    if frame.stdout:
                        seen_output = True
                        for line in lines.feed(frame.stdout):
                            done = await self._deliver(line)
                            if done is not None:
                                return done
                    if frame.exit_code not in (None, 0):
                        self._client_failed(stderr)
                        return None
                return await self._deliver(lines.close())  # an unfinished last line, if any
        except NotFoundError as exc:
            await self.client.get_sandbox(self.sandbox_id)  # raises NotFoundError itself if the sandbox is gone
            raise StreamingUnavailable(str(exc)) from None
        except ServerError as exc:
            if exc.status_code in GATEWAY_GAVE_UP and not seen_output:
                raise StreamingUnavailable(f"HTTP {exc.status_code} on a long-held exec") from None
            log.warning("exec stream failed after seq %d: %s", self.last_seq, exc)
        except RECOVERABLE as exc:
            log.warning("exec stream dropped after seq %d: %s", self.last_seq, exc)
        return None

    async def poll(self, runner_args: list[str]) -> dict[str, Any] | None:
        """One buffered exec: deliver the events it returns; `done` if the cell finished."""
        self.broken = True
        try:
            response = await self.client.exec(self.sandbox_id, self.transport.python, runner_args)
        except RECOVERABLE as exc:
            log.warning("exec poll failed after seq %d: %s", self.last_seq, exc)
            return None
        result = response.result
        if result.exit_code != 0:
            for line in result.stdout.split("\n"):
                await self._deliver(line)  # raises at the client's error line (the runner is gone)
            self._client_failed(result.error or result.stderr)
            return None
        self.broken = False
        for line in result.stdout.split("\n"):
            done = await self._deliver(line)
            if done is not None:
                return done
        return None

    def _client_failed(self, stderr: str) -> None:
        """The runner client ended without a word: killed (the OOM killer) or never started
        (no process could be made at the pids limit). Like a dropped stream it is tried
        again, and a runner that died meanwhile is then reported as such; one that keeps
        failing is reported with its last words."""
        log.warning("the runner client failed after seq %d: %s", self.last_seq, stderr.strip()[-500:])
        self.client_failures += 1
        if self.client_failures >= CLIENT_FAILURES_BEFORE_GIVING_UP:
            raise runner_failed(stderr)

    async def _deliver(self, line: str | OversizedLine) -> dict[str, Any] | None:
        if isinstance(line, OversizedLine):
            await self.on_event({"type": "stream", "name": "stderr", "text": (
                f"[sandbox-kernel] dropped a line of {line.size / 2**20:.1f} MiB from the sandbox: "
                f"longer than the {self.line_limit / 2**20:g} MiB a runner event may be\n")})
            return None
        if not line.strip():
            return None
        try:
            event = parse_event_line(line)
        except ValueError:  # cut off: the runner died while sending it (its client says so next)
            log.warning("skipped a partial event line from the runner")
            return None
        if protocol.SEQ not in event:  # the runner's client: {"error": ...}: the daemon died
            raise RunnerTransportError(str(event.get("error") or event), runner_gone=True)
        if event[protocol.SEQ] <= self.last_seq:
            return None  # replayed by a run with `after`: already delivered
        self.last_seq = event[protocol.SEQ]
        self.client_failures = 0
        if event[protocol.TYPE] == protocol.DONE:
            return event
        await self.on_event(event)
        return None
