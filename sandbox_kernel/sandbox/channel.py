"""The kernel's one duplex channel to its runner, over a managed process (CreateOS §15.3).

At start (and after every runner start or sandbox switch) the session's link (runner_link.py)
starts one managed process in the sandbox, `guest/runner/client.py channel DIR`: a relay that
hands its stdin and stdout to the runner daemon, which serves the channel on them (the relay
stays as `cat` of its connection to the daemon, the service's handle on it). Every request
(run a cell, interrupt, input answer, complete, inspect, info) is one stdin line, sent with
the process `input` call; every event comes back on the process's output stream, which the
kernel follows with one `connect` for its lifetime. Events name their cell (`"cell": id`),
or `"cell": null` for output produced between cells (a background thread, a subprocess),
which the kernel shows on the parent of the last cell. Replies to one-shot requests carry
the request's `"reply": id`.

Recovery: the output stream is numbered (`seq` per chunk). A dropped `connect` is opened
again with `after=<last seq>`: the service replays exactly what was missed. The relay
writes at most its window of bytes ahead of the kernel's acknowledgements (`{"ack": N}`
lines), so what the kernel has not read is always within the service's retained window;
if it is not (a provider with a smaller window), the gap is said in the cell as one line.
Interrupts are input lines too: they need no stream.

A relay that ends without last words (killed from inside the sandbox: `pkill cat` in a
cell, the OOM killer; or its daemon died, closing its connection) says nothing for sure
about its daemon, which usually lives on: a new relay is started in its place, and the
cell in flight is asked for again with `after` its last event, so the daemon sends only
what the kernel has not seen (variables and all are kept); a dead daemon is what the new
relay finds. A relay's own verdict ({"error": ...}: the daemon cannot be reached or
refused the channel) ends the channel as a runner death, which the channel's owner hears
at once (on_runner_gone), between cells too.

Bounds: the channel's stdout is sandbox-controlled (the daemon writes it, and code in the
sandbox can too, or replace the relay file). Lines are cut with BoundedLines (an unterminated line is counted, never
held), nothing is stored per event, and events are checked before use: a line that is
not an event of a cell in flight, the background, or a pending reply is ignored.

More than one cell may be in flight: a frontend's comm message is delivered while a cell
runs (it may be what the cell awaits), each followed to its own `done`.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import itertools
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from sandbox_kernel.guest import protocol
from sandbox_kernel.api import (
    BoundedLines,
    ConflictError,
    CreateProcessRequest,
    NotFoundError,
    OversizedLine,
    ProcessFrame,
    ProtocolError,
    SandboxAPIError,
    SandboxClient,
    SandboxStatus,
)
from sandbox_kernel.sandbox.event_lines import parse_event_line
from sandbox_kernel.sandbox.transport import (RECONNECT_DELAYS, RECOVERABLE, EventHandler, RunnerTransportError,
                                              reconnect_delay)

log = logging.getLogger("sandbox_kernel.sandbox.channel")

# Acknowledge the relay's output every this many bytes: half its window, the other half
# covering the acknowledgement's trip. Each one is an API call, the costliest step of a
# long print per byte on the kernel's side and the engine's (a quarter window made twice
# as many, for no gain in flow).
ACK_EVERY = protocol.CHANNEL_WINDOW // 2
REQUEST_TIMEOUT = 60.0  # seconds a one-shot request (complete, inspect, info) may take
# Relays replaced in a row with no output from any of them: past this, the channel ends
# (a cell that kills every relay it sees would otherwise keep us starting new ones).
RELAY_REPLACEMENTS = 3
# Seconds a request refused by its relay waits for the reader to replace that relay or end
# the channel (it learns either from the relay's exit on the stream, moments later).
RELAY_SETTLE_WAIT = 10.0
# A reader that found the sandbox paused waits for the session to resume it (its next cell
# does); in case someone else resumes it, it asks the service again every five minutes (an
# idle paused notebook should cost the service next to nothing).
PAUSED_RECHECK = 300.0
# Statuses with which a provider says it has no managed processes.
NO_PROCESSES = (404, 405, 501)


class ChannelUnavailable(Exception):
    """The provider has no managed processes: the session uses one exec per request instead
    (runner_link.py)."""


class _RelayKilled(Exception):
    """The relay exited without last words: its daemon may well be alive."""


class _StreamEndedByTheService(ProtocolError):
    """An error frame: the service ended the stream, and may say why when asked (the sandbox
    went, say); a stream dropped with no word is most often the network's doing."""


class ProcessTransport(Protocol):
    """What the channel needs of managed processes (tests script it; see SandboxProcesses)."""

    async def create(self, args: list[str]) -> str: ...

    def connect(self, process_id: str, after: int) -> AbstractAsyncContextManager[AsyncIterator[ProcessFrame]]: ...

    async def send(self, process_id: str, data: bytes) -> None: ...

    async def kill(self, process_id: str) -> None: ...

    async def sandbox_status(self) -> SandboxStatus: ...


class SandboxProcesses:
    """ProcessTransport over the CreateOS API (or the local engine, which speaks it)."""

    def __init__(self, client: SandboxClient, sandbox_id: str, python: str) -> None:
        self.client = client
        self.sandbox_id = sandbox_id
        self.python = python

    async def create(self, args: list[str]) -> str:
        # Meanwhile the connection for the process's input calls is opened: the first cell
        # would otherwise wait for its handshakes (one or two round trips to a distant service).
        preparing = asyncio.ensure_future(self.client.prepare_process_calls())
        try:
            process = await self.client.create_process(self.sandbox_id,
                                                       CreateProcessRequest(cmd=self.python, args=args))
        except BaseException as exc:
            preparing.cancel()
            if isinstance(exc, SandboxAPIError) and exc.status_code in NO_PROCESSES:
                raise ChannelUnavailable(f"HTTP {exc.status_code} on creating a process") from None
            raise
        await preparing
        return process.process_id

    @contextlib.asynccontextmanager
    async def connect(self, process_id: str, after: int) -> AsyncIterator[AsyncIterator[ProcessFrame]]:
        async with self.client.connect_process(self.sandbox_id, process_id, after=after) as frames:
            yield frames.__aiter__()

    async def send(self, process_id: str, data: bytes) -> None:
        await self.client.process_input(self.sandbox_id, process_id, data)

    async def kill(self, process_id: str) -> None:
        await self.client.kill_process(self.sandbox_id, process_id)

    async def sandbox_status(self) -> SandboxStatus:
        """Raises NotFoundError once the sandbox is gone."""
        return (await self.client.get_sandbox(self.sandbox_id)).status


@dataclass
class _CellFollow:
    cell_id: str
    request: dict[str, Any]  # its run request, sent again to a relay that replaces a killed one
    on_event: EventHandler
    done: asyncio.Future[dict[str, Any]]
    last_seq: int = 0  # the cell's own event numbering (the runner's Cell)


@dataclass
class _Reading:
    """Where the reader is in the process's output (kept across reconnects)."""

    seq: int = 0  # last output chunk taken
    received: int = 0  # stdout bytes taken
    acked: int = 0
    decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))


class RunnerChannel:
    """One relay process and the stream of its output; see the module docstring. A
    RunnerTransport (transport.py)."""

    def __init__(self, transport: ProcessTransport, relay_args: Callable[[int], list[str]], line_limit: int,
                 on_background: EventHandler, *, background_seq: int = 0,
                 on_runner_gone: Callable[[RunnerTransportError], None] | None = None) -> None:
        self.transport = transport
        self.relay_args = relay_args  # the relay's arguments, given the background seq to follow after
        self.line_limit = line_limit
        self.on_background = on_background
        self.background_seq = background_seq
        # Told (once) when the channel ends because the runner died or its sandbox went,
        # whether or not a request was waiting: a death between cells is learnt at once.
        self.on_runner_gone = on_runner_gone
        self.process_id = ""
        self.failure: RunnerTransportError | None = None  # why the channel ended, once it has
        self._reading = _Reading()
        self._lines = BoundedLines(line_limit)
        self._cells: dict[str, _CellFollow] = {}  # in flight, in the order they were sent
        self._replies: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._ids = itertools.count(1)
        self._last_words = ""  # the relay's {"error": ...} line, before it exits
        self._reader: asyncio.Task[None] | None = None
        self._acks: set[asyncio.Task[None]] = set()
        # Set when the session has the sandbox running again: a reader that found it paused
        # waits for this rather than asking the service every few seconds (sandbox_running).
        self._running_again = asyncio.Event()
        # Set when a relay is replaced or the channel ends: a request its relay refused waits for it.
        self._relay_changed = asyncio.Event()
        # The engine's count of egress refusals, from its heartbeats (local/processes.py), which
        # it sends when the count moves: 0 until then. The sandbox can forge frames, so this
        # only says when to ask the engine for the refusals.
        self.egress_refusals = 0

    @property
    def alive(self) -> bool:
        return self.failure is None and self._reader is not None

    async def open(self) -> None:
        """Start the relay and follow its output (ChannelUnavailable: no managed processes)."""
        self.process_id = await self.transport.create(self.relay_args(self.background_seq))
        self._reader = asyncio.get_running_loop().create_task(self._read_forever())

    async def close(self, kill: bool = True) -> bool:
        """Stop following, and end the relay if `kill` (best effort: it ends with its daemon).

        False if the relay could not be ended now because its sandbox is paused (which
        refuses the kill): close it again once the sandbox runs.
        """
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        self._end(RunnerTransportError("the channel was closed"))
        if kill and self.process_id:
            try:
                await self.transport.kill(self.process_id)
            except ConflictError:
                return False
            except (SandboxAPIError, OSError) as exc:  # gone already, or not to be known now
                log.warning("could not end the relay %s: %s", self.process_id, exc)
        return True

    # -- requests ---------------------------------------------------------------------------

    async def run_cell(self, cell_id: str, request: dict[str, Any], on_event: EventHandler,
                       on_sent: Callable[[], None] | None = None) -> dict[str, Any]:
        """Send a run request and deliver the cell's events in order; return its done event.
        on_sent() once the service took the request (the relay's stdin has it)."""
        self._check()
        request = {**request, protocol.OP: protocol.RUN, protocol.CELL_ID: cell_id}
        follow = _CellFollow(cell_id, request, on_event, asyncio.get_running_loop().create_future())
        self._cells[cell_id] = follow
        try:
            await self.send(request)
            if on_sent is not None:
                on_sent()
            return await follow.done
        finally:
            self._cells.pop(cell_id, None)

    async def request(self, message: dict[str, Any], timeout: float = REQUEST_TIMEOUT) -> dict[str, Any]:
        """A one-shot request with a reply (complete, inspect, info); its reply."""
        self._check()
        request_id = f"r{next(self._ids)}"
        reply = self._replies[request_id] = asyncio.get_running_loop().create_future()
        try:
            await self.send({**message, protocol.ID: request_id})
            return await asyncio.wait_for(reply, timeout)
        except asyncio.TimeoutError:
            raise RunnerTransportError(f"no answer within {timeout:.0f} s") from None
        finally:
            self._replies.pop(request_id, None)

    async def send(self, message: dict[str, Any]) -> None:
        """One request line (interrupt and input need no reply, nor the output stream)."""
        line = _request_line(message)
        process_id = self.process_id
        try:
            await self.transport.send(process_id, line)
        except ConflictError:
            # Refused: the sandbox is paused (the caller resumes it and asks again), or the
            # relay's input has no reader any more (the relay ended, or the daemon that
            # read it died). Then the stream's reader settles it: a new relay, which is
            # sent the cells in flight again, or the channel's end, which may have come
            # while the input was on its way (then its reason, a runner death say, is the answer).
            self._check()
            if await self._sandbox_paused():
                raise
            await self._relay_settled(process_id)
            self._check()
            # A cell in flight was sent again by the new relay's start, and a request's
            # reply was failed by it ("ask again"); anything else goes to the new relay.
            if message.get(protocol.CELL_ID) not in self._cells and protocol.ID not in message:
                await self.transport.send(self.process_id, line)
        self._running_again.set()  # it was taken: the sandbox runs, so may its stream

    async def _relay_settled(self, lost: str) -> None:
        """Wait (at most RELAY_SETTLE_WAIT) until the reader has replaced relay `lost` or
        ended the channel; a ConflictError if neither came."""
        deadline = asyncio.get_running_loop().time() + RELAY_SETTLE_WAIT
        while self.failure is None and self.process_id == lost:
            if asyncio.get_running_loop().time() > deadline:
                raise ConflictError(f"the relay {lost} takes no input and was not replaced")
            self._relay_changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._relay_changed.wait(), RELAY_SETTLE_WAIT)

    def _check(self) -> None:
        if self.failure is not None:
            raise self.failure

    # -- the output stream -----------------------------------------------------------------

    def sandbox_running(self) -> None:
        """The session has the sandbox running again: a reader waiting out a pause goes on."""
        self._running_again.set()

    async def _read_forever(self) -> None:
        failures = 0
        replacements = 0
        # A refusal of the stream (409) is looked into at once: after another, or after the
        # service's word that the stream ended (an error frame, as when the sandbox went).
        ask_why = False
        try:
            while True:
                progress = self._reading.seq
                dropped_by: Exception | None = None
                try:
                    async with self.transport.connect(self.process_id, self._reading.seq) as frames:
                        ask_why = False
                        async for frame in frames:
                            if await self._take(frame):
                                return
                except _RelayKilled as exc:
                    replacements = 0 if self._reading.seq > 0 else replacements + 1
                    if replacements > RELAY_REPLACEMENTS:
                        self._end(RunnerTransportError("the relay to the runner in the sandbox keeps being killed"))
                        return
                    log.warning("%s: starting a new one", exc)
                    await self._replace_relay_once_running()
                    failures = 0
                    continue
                except RECOVERABLE as exc:
                    log.warning("channel stream dropped after seq %d: %s", self._reading.seq, exc)
                    dropped_by = exc
                    if isinstance(exc, _StreamEndedByTheService):
                        ask_why = True
                except ConflictError:
                    # Not running: paused (its next cell resumes it, and the stream replays
                    # from where it stopped), or ended, which ends the runner (the outer
                    # handler). For an idle channel whose stream was cut, paused is by far
                    # the likelier, so its first refusal is not looked into: the cut streams
                    # of a hundred paused notebooks cost the service one request each, not two.
                    self._running_again.clear()
                    status = await self._sandbox_status() if ask_why or self._cells or self._replies else None
                    if status is not SandboxStatus.RUNNING:  # (else resumed just now: try again soon)
                        if status is not None and not status.is_pause_like:
                            raise
                        ask_why = True
                        await self._wait_while_paused()
                        continue
                if self._reading.seq > progress:
                    failures = 0
                if failures == len(RECONNECT_DELAYS):
                    self._end(RunnerTransportError("lost the connection to the sandbox; the cell's output so far "
                                           "is shown above"))
                    return
                await asyncio.sleep(reconnect_delay(failures, dropped_by))
                failures += 1
        except (NotFoundError, ConflictError) as exc:  # the process or the sandbox is gone
            self._end(RunnerTransportError(f"the channel to the runner failed: {exc.user_message()}", runner_gone=True))
        except SandboxAPIError as exc:
            # Refused (the key, the account, a request the service will not take): that
            # says nothing of the runner, which may well live on. The next request opens
            # the channel again (runner_link.ensure_up), or says why it cannot.
            self._end(RunnerTransportError(f"the channel to the runner failed: {exc.user_message()}"))
        except Exception as exc:  # a bug of ours: end the cell with it rather than hang
            log.exception("the channel reader failed")
            self._end(RunnerTransportError(f"internal error in the channel ({type(exc).__name__}: {exc})"))

    async def _wait_while_paused(self) -> None:
        """Wait for the session's word that the sandbox runs again, or PAUSED_RECHECK seconds,
        after which the caller tries again (someone else may have resumed it)."""
        # With work in flight (paused by someone else mid-cell), try as often as for a dropped
        # stream; the long waits are for an idle notebook.
        busy = bool(self._cells or self._replies)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._running_again.wait(), RECONNECT_DELAYS[-1] if busy else PAUSED_RECHECK)

    async def _replace_relay_once_running(self) -> None:
        """A new relay for a killed one. A sandbox paused or in a transition refuses a new
        process (409), but its runner lives on: the new relay waits for it to run again
        (taking the refusal for the runner's death would lose the notebook's Python)."""
        while True:
            try:
                await self._replace_relay()
                return
            except ConflictError:
                self._running_again.clear()
                if not await self._sandbox_paused():
                    raise
            await self._wait_while_paused()

    async def _replace_relay(self) -> None:
        """A new relay in place of one that was killed; each cell in flight is asked for
        again from its last event (a run of a known cell only follows it, and one the old
        relay never passed on starts now). Pending replies died with the old relay."""
        self.process_id = await self.transport.create(self.relay_args(self.background_seq))
        self._relay_changed.set()
        self._reading = _Reading()
        self._lines = BoundedLines(self.line_limit)
        self._last_words = ""
        for reply in self._replies.values():
            if not reply.done():
                reply.set_exception(RunnerTransportError("the relay to the runner was replaced; ask again"))
        for follow in list(self._cells.values()):
            # Refused if this relay ended already: its exit, read next, says why.
            with contextlib.suppress(ConflictError):
                await self.transport.send(self.process_id, _request_line({**follow.request,
                                                                          protocol.AFTER: follow.last_seq}))

    async def _sandbox_status(self) -> SandboxStatus | None:
        """None if it cannot be known now (then wait and ask again, as for a paused sandbox)."""
        try:
            status = await self.transport.sandbox_status()
        except RECOVERABLE as exc:
            log.warning("could not read the sandbox's state: %s", exc)
            return None
        if not status.is_pause_like:  # a reader waiting out a pause need not wait for the session's word
            self._running_again.set()
        return status

    async def _sandbox_paused(self) -> bool:
        """Paused or on its way there or back (its next cell resumes it), or not known now."""
        status = await self._sandbox_status()
        return status is None or status.is_pause_like

    async def _take(self, frame: ProcessFrame) -> bool:
        """Handle one frame; True once the relay has exited."""
        kind = frame.type.value
        if kind == "heartbeat" and frame.egress_denied_count is not None:
            self.egress_refusals = frame.egress_denied_count
        if kind == "error":
            raise _StreamEndedByTheService(f"error frame: {frame.error}")
        if kind == "exit":
            await self._lines_of(self._lines.close())
            if not self._last_words:
                raise _RelayKilled(f"the relay ended without a word (exit code {frame.exit_code}, "
                                   f"signal {frame.signal})")
            self._end(RunnerTransportError(self._last_words, runner_gone=True))
            return True
        if kind != "data" or frame.seq is None or frame.seq <= self._reading.seq:
            return False  # a heartbeat, or replayed after a reconnect: taken already
        if frame.oldest_available_seq is not None and frame.oldest_available_seq > self._reading.seq + 1:
            missed = frame.oldest_available_seq - self._reading.seq - 1
            self._lines = BoundedLines(self.line_limit)  # its unfinished line lost its start
            await self._notice(f"[sandbox-kernel] {missed} chunks of output were lost: the connection to the "
                               "sandbox was down longer than the service keeps output\n")
        self._reading.seq = frame.seq
        if frame.stream is None or frame.stream.value != "stdout":
            return False  # the relay's stderr: nothing the kernel needs
        data = frame.data
        self._reading.received += len(data)
        for line in self._lines.feed(self._reading.decoder.decode(data)):
            await self._lines_of(line)
        if self._reading.received - self._reading.acked >= ACK_EVERY:
            self._acknowledge()
        return False

    def _acknowledge(self) -> None:
        self._reading.acked = self._reading.received
        task = asyncio.get_running_loop().create_task(self._send_ack(self._reading.acked))
        self._acks.add(task)
        task.add_done_callback(self._acks.discard)

    async def _send_ack(self, received: int) -> None:
        try:
            await self.transport.send(self.process_id, b'{"ack": %d}\n' % received)
        except (SandboxAPIError, OSError) as exc:  # the next one acknowledges this too
            log.warning("channel acknowledgement failed: %s", exc)

    async def _lines_of(self, line: str | OversizedLine) -> None:
        if isinstance(line, OversizedLine):
            await self._notice(f"[sandbox-kernel] dropped a line of {line.size / 2**20:.1f} MiB from the sandbox: "
                               f"longer than the {self.line_limit / 2**20:g} MiB a runner event may be\n")
            return
        if not line.strip():
            return
        try:
            event = parse_event_line(line)
        except ValueError:  # cut off by a dying daemon, or not ours
            log.warning("skipped a line from the channel that is not JSON")
            return
        if isinstance(event, dict):
            await self._dispatch(event)

    async def _dispatch(self, event: dict[str, Any]) -> None:
        reply_to, cell_id, seq = event.get(protocol.REPLY), event.get(protocol.CELL), event.get(protocol.SEQ)
        if isinstance(reply_to, str) or (protocol.ERROR in event and protocol.SEQ not in event):
            self._answer(event)
        elif protocol.CELL not in event or not isinstance(seq, int) or not isinstance(event.get(protocol.TYPE), str):
            return  # not an event
        elif cell_id is None:
            if seq > self.background_seq:
                self.background_seq = seq
                await self.on_background(event)
        elif isinstance(cell_id, str) and cell_id in self._cells and seq > self._cells[cell_id].last_seq:
            follow = self._cells[cell_id]
            follow.last_seq = seq
            if event[protocol.TYPE] == protocol.DONE:
                if not follow.done.done():
                    follow.done.set_result(event)
            else:
                await follow.on_event(event)

    def _answer(self, event: dict[str, Any]) -> None:
        """A reply, or an error about a request (with its id or cell), or the relay's last words."""
        request_id = event.get(protocol.REPLY) or event.get(protocol.ID)
        reply = self._replies.get(request_id) if isinstance(request_id, str) else None  # the sandbox's word
        if reply is not None and not reply.done():
            reply.set_result(event)
            return
        message = str(event.get(protocol.ERROR))[:500]
        cell_id = event.get(protocol.CELL_ID)
        refused = self._cells.get(cell_id) if isinstance(cell_id, str) else None
        if refused is not None:
            if not refused.done.done():
                refused.done.set_exception(RunnerTransportError(f"the runner refused the cell: {message}"))
        elif protocol.REPLY not in event and protocol.ERROR in event:
            self._last_words = message

    async def _notice(self, text: str) -> None:
        """One line from the kernel, in the first cell in flight (else on the last cell's parent)."""
        event = {protocol.TYPE: protocol.STREAM, "name": "stderr", "text": text}
        if self._cells:
            await next(iter(self._cells.values())).on_event(event)
        else:
            await self.on_background(event)

    def _end(self, failure: RunnerTransportError) -> None:
        """The channel is over: everything waiting on it hears why (and, if the runner is
        gone, on_runner_gone)."""
        if self.failure is not None:
            return
        self.failure = failure
        self._relay_changed.set()
        for follow in self._cells.values():
            if not follow.done.done():
                follow.done.set_exception(self.failure)
        for reply in self._replies.values():
            if not reply.done():
                reply.set_exception(self.failure)
        if failure.runner_gone and self.on_runner_gone is not None:
            self.on_runner_gone(failure)


def _request_line(message: dict[str, Any]) -> bytes:
    """A request as the relay's stdin takes it: one JSON line."""
    return (json.dumps(message) + "\n").encode()
