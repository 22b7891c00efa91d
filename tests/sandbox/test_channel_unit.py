"""The channel's recovery logic (sandbox_kernel/channel.py) against a scripted managed process:
no engine, no sandbox. The process keeps a numbered output window as a provider does, and
its connections are cut, rewound or left behind the window as the test says."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from sandbox_kernel.sandbox import channel as channel_module
from sandbox_kernel.api import APITransportError, ConflictError, ProcessFrame, SandboxStatus
from sandbox_kernel.sandbox.channel import ACK_EVERY, RunnerChannel
from sandbox_kernel.sandbox.transport import RunnerTransportError

LINE_LIMIT = 1 << 20
Events = Callable[[dict[str, Any]], list[dict[str, Any]]]


class ScriptedProcess:
    """A relay's output as a provider keeps it: chunks numbered from 1, the newest
    `window` of them retained. Requests written to it are answered by `respond`, whose
    events are written as lines cut into `chunk`-byte pieces (so lines span chunks)."""

    def __init__(self, respond: Events, chunk: int = 7, window: int = 10_000) -> None:
        self.respond = respond
        self.chunk = chunk
        self.window = window
        self.output: list[bytes] = []
        self.cuts: list[int] = []  # connection n is cut after cuts[n] frames (then they pass)
        self.rewind = 0  # a server that replays this many frames before `after`
        self.connects: list[int] = []  # the `after` of each connect
        self.sent: list[bytes] = []
        self.exit_frame: dict[str, Any] | None = None
        self.connect_fails = 0  # the next this many connects fail at once
        self.status = "running"  # another status: connects are refused (409)
        self.status_fails = 0  # the next this many reads of the sandbox's status fail at once
        self.status_reads = 0
        self.resumed_by_the_look = False  # a read of the status finds the sandbox running
        self.relays: list[list[str]] = []  # the arguments of every relay started
        self.killed_at_start = 0  # the next this many relays are killed before they write
        self.input_refused = 0  # the next this many sends are refused (409), as to a relay whose reader died
        self.while_refusing: Callable[[], Awaitable[None]] | None = None  # awaited before a send's refusal
        self.refuse_creates = False  # new relays are refused (409), as by a sandbox paused or in a transition
        self.refused_creates = 0
        self._changed = asyncio.Condition()

    async def write(self, data: bytes) -> None:
        async with self._changed:
            self.output += [data[i:i + self.chunk] for i in range(0, len(data), self.chunk)]
            self._changed.notify_all()

    async def exit(self, last_words: bytes, **frame: Any) -> None:
        await self.write(last_words)
        async with self._changed:
            self.exit_frame = {"type": "exit", "seq": len(self.output), **frame}
            self._changed.notify_all()

    async def destroy_sandbox(self) -> None:
        """The sandbox ends under the process: the open stream ends in an error frame."""
        async with self._changed:
            self.status = "destroyed"
            self._changed.notify_all()

    # -- ProcessTransport

    async def create(self, args: list[str]) -> str:
        """A relay; a new one (after a kill) starts with an output of its own."""
        if self.refuse_creates:
            self.refused_creates += 1
            raise ConflictError("sandbox is paused, not running", status_code=409)
        self.relays.append(args)
        if len(self.relays) > 1:
            async with self._changed:
                self.output, self.exit_frame = [], None
        if self.killed_at_start:
            self.killed_at_start -= 1
            self.exit_frame = {"type": "exit", "seq": 0, "signal": "SIGKILL"}
        return f"proc-{len(self.relays)}"

    @contextlib.asynccontextmanager
    async def connect(self, process_id: str, after: int) -> AsyncIterator[AsyncIterator[ProcessFrame]]:
        self.connects.append(after)
        if self.connect_fails:
            self.connect_fails -= 1
            raise APITransportError("connection refused")
        if self.status != "running":
            raise ConflictError(f"sandbox is {self.status}, not running", status_code=409)
        cut = self.cuts[len(self.connects) - 1] if len(self.connects) <= len(self.cuts) else None
        yield self._frames(max(0, after - self.rewind), cut)

    async def _frames(self, after: int, cut: int | None) -> AsyncIterator[ProcessFrame]:
        seq, sent = after, 0
        oldest = max(1, len(self.output) - self.window + 1)
        if seq + 1 < oldest:  # fell out of the window
            seq = oldest - 1
            yield self._data(seq + 1, oldest_available_seq=oldest)
            seq, sent = seq + 1, 1
        while True:
            async with self._changed:
                await self._changed.wait_for(lambda: len(self.output) > seq or self.exit_frame is not None
                                             or self.status == "destroyed")
            if self.status == "destroyed":
                yield ProcessFrame.from_wire({"type": "error", "error": "the sandbox ended"})
                return
            if len(self.output) > seq:
                if cut is not None and sent >= cut:
                    raise APITransportError("cut by the test")
                seq += 1
                sent += 1
                yield self._data(seq)
            else:
                yield ProcessFrame.from_wire(self.exit_frame)
                return

    def _data(self, seq: int, **extra: Any) -> ProcessFrame:
        return ProcessFrame.from_wire({"type": "data", "seq": seq, "stream": "stdout",
                                            "data_base64": base64.b64encode(self.output[seq - 1]).decode(),
                                            **extra})

    async def send(self, process_id: str, data: bytes) -> None:
        if self.input_refused:
            self.input_refused -= 1
            if self.while_refusing is not None:
                await self.while_refusing()
            raise ConflictError("stdin: Broken pipe", status_code=409)
        self.sent.append(data)
        request = json.loads(data)
        if "ack" not in request:
            for event in self.respond(request):
                await self.write(json.dumps(event).encode() + b"\n")

    async def kill(self, process_id: str) -> None:
        pass

    async def sandbox_status(self) -> SandboxStatus:
        self.status_reads += 1
        if self.status_fails:
            self.status_fails -= 1
            raise APITransportError("connection refused")
        if self.resumed_by_the_look:
            self.status = "running"
        return SandboxStatus(self.status)


async def _until(condition: Callable[[], bool], within: float = 10.0) -> None:
    """Wait for `condition` (a state the code under test reaches), failing after `within` s."""
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.01)
    await asyncio.wait_for(poll(), within)


def printing_cell(lines: int) -> Events:
    """A runner whose every cell prints `lines` numbered lines, then ends."""
    def respond(request: dict[str, Any]) -> list[dict[str, Any]]:
        if request.get("op") != "run":
            return [{"reply": request.get("id"), "op": request.get("op")}] if "id" in request else []
        cell = request["cell_id"]
        events = [{"cell": cell, "seq": i + 1, "type": "stream", "name": "stdout", "text": f"{i}\n"}
                  for i in range(lines)]
        return events + [{"cell": cell, "seq": lines + 1, "type": "done", "status": "ok"}]
    return respond


class Recorder:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.background: list[dict[str, Any]] = []

    async def cell(self, event: dict[str, Any]) -> None:
        self.events.append(event)

    async def between_cells(self, event: dict[str, Any]) -> None:
        self.background.append(event)

    def text(self, name: str = "stdout") -> str:
        return "".join(e["text"] for e in self.events if e["type"] == "stream" and e["name"] == name)


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(channel_module, "RECONNECT_DELAYS", (0.0,) * 4)
    monkeypatch.setattr(channel_module, "PAUSED_RECHECK", 0.0)


async def open_channel(process: ScriptedProcess, recorder: Recorder) -> RunnerChannel:
    channel = RunnerChannel(process, lambda after: ["channel", str(after)], LINE_LIMIT, recorder.between_cells)
    await channel.open()
    return channel


async def run(channel: RunnerChannel, recorder: Recorder, cell_id: str = "c1") -> dict[str, Any]:
    return await asyncio.wait_for(channel.run_cell(cell_id, {"code": "..."}, recorder.cell), 10)


async def test_a_stream_cut_three_times_mid_cell_loses_and_repeats_nothing() -> None:
    process, recorder = ScriptedProcess(printing_cell(200)), Recorder()
    process.cuts = [40, 40, 40]  # frames of 7 bytes: each cut falls inside a line
    channel = await open_channel(process, recorder)
    done = await run(channel, recorder)
    assert done["status"] == "ok"
    assert recorder.text() == "".join(f"{i}\n" for i in range(200))
    assert process.connects == [0, 40, 80, 120], "each reconnect asks for what follows the last chunk"
    await channel.close()


async def test_frames_replayed_by_the_server_are_taken_once() -> None:
    process, recorder = ScriptedProcess(printing_cell(50)), Recorder()
    process.cuts, process.rewind = [10, 10], 6
    channel = await open_channel(process, recorder)
    await run(channel, recorder)
    assert recorder.text() == "".join(f"{i}\n" for i in range(50))
    await channel.close()


async def test_a_gap_beyond_the_window_is_one_line_in_the_cell() -> None:
    process, recorder = ScriptedProcess(printing_cell(300), window=40), Recorder()
    process.cuts = [5]
    channel = await open_channel(process, recorder)
    # The second connection starts once the cell's output has long left the window.
    done = await run(channel, recorder)
    assert done["status"] == "ok"
    [notice] = [e["text"] for e in recorder.events if e["name"] == "stderr"]
    assert notice.startswith("[sandbox-kernel] ") and "chunks of output were lost" in notice
    shown = recorder.text().splitlines()
    assert shown[-1] == "299" and len(shown) < 300 and len(set(shown)) == len(shown)
    await channel.close()


async def test_output_between_cells_goes_to_the_background_handler_once() -> None:
    process, recorder = ScriptedProcess(printing_cell(1)), Recorder()
    process.cuts = [3]
    channel = await open_channel(process, recorder)
    await run(channel, recorder)
    for seq in (1, 2, 2, 3):  # one replayed by a confused runner
        await process.write(json.dumps({"cell": None, "seq": seq, "type": "stream", "name": "stdout",
                                        "text": f"bg {seq}\n"}).encode() + b"\n")
    await asyncio.wait_for(_until(lambda: len(recorder.background) == 3), 10)
    assert [e["text"] for e in recorder.background] == ["bg 1\n", "bg 2\n", "bg 3\n"]
    assert channel.background_seq == 3
    await channel.close()


async def test_forged_and_oversized_lines_are_dropped_and_the_cell_still_ends() -> None:
    def respond(request: dict[str, Any]) -> list[dict[str, Any]]:
        return []

    process, recorder = ScriptedProcess(respond, chunk=64 * 1024), Recorder()
    channel = await open_channel(process, recorder)
    cell = asyncio.ensure_future(run(channel, recorder))
    await asyncio.sleep(0)
    junk = [b"x" * (10 * LINE_LIMIT) + b"\n", b"not json\n", b"[1, 2]\n", b"\xff\xfe\n",
            b'{"cell": "other", "seq": 1, "type": "stream", "name": "stdout", "text": "forged"}\n',
            b'{"reply": "r999", "matches": []}\n', b'{"cell": "c1", "type": "stream", "text": "no seq"}\n',
            b'{"cell": "c1", "seq": 1, "type": "stream", "name": "stdout", "text": "real"}\n',
            b'{"cell": "c1", "seq": 1, "type": "stream", "name": "stdout", "text": "twice"}\n',
            b'{"cell": "c1", "seq": 2, "type": "done", "status": "ok"}\n']
    for line in junk:
        await process.write(line)
    assert (await cell)["status"] == "ok"
    assert recorder.text() == "real"
    [notice] = [e["text"] for e in recorder.events if e["name"] == "stderr"]
    assert notice.startswith("[sandbox-kernel] dropped a line of 10.0 MiB")
    await channel.close()


async def test_replies_are_matched_to_their_requests() -> None:
    process, recorder = ScriptedProcess(printing_cell(0)), Recorder()
    channel = await open_channel(process, recorder)
    first, second = await asyncio.gather(channel.request({"op": "complete"}), channel.request({"op": "inspect"}))
    assert (first["op"], second["op"]) == ("complete", "inspect")
    await channel.close()


async def test_the_relay_ending_fails_the_cell_with_its_last_words() -> None:
    process, recorder = ScriptedProcess(lambda request: []), Recorder()
    channel = await open_channel(process, recorder)
    cell = asyncio.ensure_future(run(channel, recorder))
    await asyncio.sleep(0)
    await process.exit(b'\n{"error": "the runner daemon closed the channel"}\n', exit_code=1)
    with pytest.raises(RunnerTransportError) as failure:
        await cell
    assert failure.value.runner_gone and str(failure.value) == "the runner daemon closed the channel"
    assert not channel.alive


async def test_a_cell_its_relay_refused_is_sent_by_the_next_relay_or_fails_with_the_channel() -> None:
    """The daemon reads the relay's stdin itself: once it died, the cell's input is refused
    (409) and the relay ends without a word. The cell waits for what the reader makes of
    that, not failing with the refusal: a new relay, sent the cell again, whose daemon is
    not there either, so the channel ends as a runner death."""
    process, recorder = ScriptedProcess(lambda request: []), Recorder()
    channel = await open_channel(process, recorder)
    process.input_refused = 1
    cell = asyncio.ensure_future(run(channel, recorder))
    await _until(lambda: not process.input_refused)
    await process.exit(b"", exit_code=0)
    await _until(lambda: len(process.relays) == 2 and bool(process.sent) or cell.done())
    assert not cell.done(), "the cell did not fail with its relay's refusal"
    assert json.loads(process.sent[-1])["op"] == "run", "the new relay was sent the cell"
    await process.exit(b'{"error": "daemon unreachable: [Errno 111] Connection refused"}\n', exit_code=1)
    with pytest.raises(RunnerTransportError) as failure:
        await cell
    assert failure.value.runner_gone and "daemon unreachable" in str(failure.value)


async def test_a_cell_refused_by_a_relay_whose_channel_ended_meanwhile_fails_with_the_channels_reason() -> None:
    """The runner killed through another transport: its relay reports the daemon gone, and the
    channel ends, while a cell's input to that relay is on its way and then refused. The
    cell fails with the channel's reason (a runner death), not the bare refusal."""
    process, recorder = ScriptedProcess(lambda request: []), Recorder()
    channel = await open_channel(process, recorder)

    async def channel_ends() -> None:
        await process.exit(b'{"error": "daemon unreachable: [Errno 111] Connection refused"}\n', exit_code=1)
        await _until(lambda: channel.failure is not None)
    process.input_refused, process.while_refusing = 1, channel_ends
    with pytest.raises(RunnerTransportError) as failure:
        await run(channel, recorder)
    assert failure.value.runner_gone and "daemon unreachable" in str(failure.value)


async def test_a_relay_killed_mid_cell_is_replaced_and_the_cell_goes_on() -> None:
    """The relay killed in a cell: its daemon lives on, so does the cell."""
    def respond(request: dict[str, Any]) -> list[dict[str, Any]]:
        after = request.get("after", 0)
        events = [{"cell": "c1", "seq": i, "type": "stream", "name": "stdout", "text": f"{i}\n"}
                  for i in range(after + 1, 6 if after else 3)]  # the first relay is killed after 2 events
        return events + ([{"cell": "c1", "seq": 6, "type": "done", "status": "ok"}] if after else [])

    process, recorder = ScriptedProcess(respond), Recorder()
    channel = await open_channel(process, recorder)
    channel.background_seq = 7  # between-cell output seen so far: the new relay follows on from it
    cell = asyncio.ensure_future(run(channel, recorder))
    while len(recorder.events) < 2:
        await asyncio.sleep(0.01)
    await process.exit(b"", exit_code=None, signal="SIGKILL")
    done = await cell
    assert done["status"] == "ok" and recorder.text() == "1\n2\n3\n4\n5\n"
    assert process.relays == [["channel", "0"], ["channel", "7"]]
    runs = [json.loads(line) for line in process.sent if b'"run"' in line]
    assert [r.get("after") for r in runs] == [None, 2] and runs[1]["code"] == "...", "asked again, from event 2"
    assert channel.alive
    await channel.close()


async def test_a_relay_killed_again_and_again_ends_the_channel_but_not_the_runner() -> None:
    process, recorder = ScriptedProcess(lambda request: []), Recorder()
    channel = await open_channel(process, recorder)
    cell = asyncio.ensure_future(run(channel, recorder))
    await asyncio.sleep(0)
    process.killed_at_start = channel_module.RELAY_REPLACEMENTS
    await process.exit(b"", signal="SIGKILL")
    with pytest.raises(RunnerTransportError) as failure:
        await cell
    assert not failure.value.runner_gone and "keeps being killed" in str(failure.value)
    assert len(process.relays) == 1 + channel_module.RELAY_REPLACEMENTS


async def test_a_relay_killed_while_the_sandbox_pauses_is_replaced_once_it_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A sandbox paused, or in a transition, refuses a new relay (409), but its runner lives
    on: the channel waits, looking again now and then, and replaces the relay once the
    session has the sandbox running again; the runner's cells go on."""
    monkeypatch.setattr(channel_module, "PAUSED_RECHECK", 0.01)
    process, recorder = ScriptedProcess(printing_cell(1)), Recorder()
    channel = await open_channel(process, recorder)
    await _until(lambda: bool(process.connects))  # its stream is open: it sees the relay's exit
    process.status, process.refuse_creates = "paused", True
    await process.exit(b"", signal="SIGKILL")
    await _until(lambda: process.refused_creates >= 3)
    assert channel.alive, "a refused relay is not the runner's death"
    process.status, process.refuse_creates = "running", False
    channel.sandbox_running()  # the session's word, having resumed it
    done = await run(channel, recorder)
    assert done["status"] == "ok" and recorder.text() == "0\n"
    assert len(process.relays) == 2
    await channel.close()


async def test_output_is_acknowledged_so_the_relay_can_write_on() -> None:
    big = "y" * 100_000
    events = 2 * ACK_EVERY // len(big) + 1  # enough output for two acknowledgements
    process = ScriptedProcess(lambda request: [
        {"cell": "c1", "seq": i + 1, "type": "stream", "name": "stdout", "text": big} for i in range(events)
    ] + [{"cell": "c1", "seq": events + 1, "type": "done", "status": "ok"}] if request.get("op") == "run" else [],
        chunk=64 * 1024)
    recorder = Recorder()
    channel = await open_channel(process, recorder)
    await run(channel, recorder)
    await asyncio.wait_for(_until(lambda: any(b'"ack"' in data for data in process.sent)), 10)
    acks = [json.loads(data)["ack"] for data in process.sent if b'"ack"' in data]
    assert acks == sorted(acks) and acks[0] >= ACK_EVERY
    await channel.close()


async def test_requests_go_out_while_the_stream_is_down() -> None:
    process, recorder = ScriptedProcess(lambda request: []), Recorder()
    process.connect_fails = 3
    channel = await open_channel(process, recorder)
    await channel.send({"op": "interrupt"})
    assert json.loads(process.sent[0]) == {"op": "interrupt"}
    await channel.close()


async def test_a_stream_that_never_comes_back_ends_the_cell_with_one_error() -> None:
    process, recorder = ScriptedProcess(lambda request: []), Recorder()
    process.connect_fails = 100
    channel = await open_channel(process, recorder)
    with pytest.raises(RunnerTransportError) as failure:
        await run(channel, recorder)
    assert "lost the connection to the sandbox" in str(failure.value) and not failure.value.runner_gone


async def test_a_destroyed_sandbox_ends_the_cell_as_a_runner_death() -> None:
    """A destroyed sandbox refuses connects with 409 (as a paused one does): the cell ends
    at once with the runner gone, instead of waiting for a resume that never comes."""
    process, recorder = ScriptedProcess(lambda request: []), Recorder()
    channel = await open_channel(process, recorder)
    cell = asyncio.ensure_future(run(channel, recorder))
    await _until(lambda: bool(process.sent))
    await process.destroy_sandbox()
    with pytest.raises(RunnerTransportError) as failure:
        await asyncio.wait_for(cell, 10)
    assert failure.value.runner_gone and "destroyed" in str(failure.value)


async def test_a_paused_sandbox_keeps_the_cell_waiting_until_it_resumes() -> None:
    process, recorder = ScriptedProcess(printing_cell(0)), Recorder()
    process.status, process.status_fails = "paused", 2  # a failed status read is no verdict
    channel = await open_channel(process, recorder)
    await _until(lambda: len(process.connects) >= 3)  # refused, and tried again
    process.status = "running"
    await asyncio.wait_for(run(channel, recorder), 10)
    await channel.close()


async def test_an_idle_channels_refused_stream_waits_without_asking_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """The service paused the sandbox and the idle channel's stream was cut: the refused
    reconnect is its one request until the session says the sandbox runs (its next cell
    resumed it) or the recheck comes; a hundred such notebooks cost one request each."""
    monkeypatch.setattr(channel_module, "PAUSED_RECHECK", 3600.0)
    process, recorder = ScriptedProcess(printing_cell(1)), Recorder()
    process.status = "paused"
    channel = await open_channel(process, recorder)
    await _until(lambda: len(process.connects) == 1)
    for _ in range(20):
        await asyncio.sleep(0)
    assert (len(process.connects), process.status_reads) == (1, 0)
    process.status = "running"
    channel.sandbox_running()
    assert (await asyncio.wait_for(run(channel, recorder), 10))["status"] == "ok"
    assert recorder.text() == "0\n" and process.status_reads == 0
    await channel.close()


async def test_an_idle_channel_refused_twice_asks_why_and_ends_with_its_sandbox() -> None:
    process, recorder = ScriptedProcess(lambda request: []), Recorder()
    process.status = "error"
    channel = await open_channel(process, recorder)
    await _until(lambda: channel.failure is not None)
    assert channel.failure is not None and channel.failure.runner_gone
    assert (len(process.connects), process.status_reads) == (2, 1)


async def test_a_sandbox_destroyed_between_cells_ends_the_channel_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The service ends the stream with its word (an error frame): the refused reconnect is
    looked into at once, not left for the recheck minutes later; the runner is gone."""
    monkeypatch.setattr(channel_module, "PAUSED_RECHECK", 3600.0)
    process, recorder = ScriptedProcess(lambda request: []), Recorder()
    gone: list[RunnerTransportError] = []
    channel = RunnerChannel(process, lambda after: ["channel", str(after)], LINE_LIMIT, recorder.between_cells,
                            on_runner_gone=gone.append)
    await channel.open()
    await _until(lambda: bool(process.connects))
    await process.destroy_sandbox()
    await _until(lambda: bool(gone))
    assert gone[0].runner_gone and "destroyed" in str(gone[0])
    assert (len(process.connects), process.status_reads) == (2, 1)


async def test_a_sandbox_found_running_after_its_refusal_is_followed_again() -> None:
    """Refused while resuming, then running when looked at: followed again, not taken for
    the runner's end (which, before, restarted the notebook's Python)."""
    process, recorder = ScriptedProcess(printing_cell(1)), Recorder()
    process.status, process.resumed_by_the_look = "resuming", True
    channel = await open_channel(process, recorder)
    assert (await asyncio.wait_for(run(channel, recorder), 10))["status"] == "ok"
    assert channel.alive and process.status_reads == 1
    await channel.close()


async def test_two_cells_in_flight_each_get_their_own_events_and_done() -> None:
    """A frontend's comm message is delivered while a cell awaits it: both are followed."""
    def respond(request: dict[str, Any]) -> list[dict[str, Any]]:
        if request["cell_id"] == "awaiting":  # it waits for the comm message: no done yet
            return [{"cell": "awaiting", "seq": 1, "type": "stream", "name": "stdout", "text": "waiting\n"}]
        return [{"cell": "comm", "seq": 1, "type": "stream", "name": "stdout", "text": "handled\n"},
                {"cell": "comm", "seq": 2, "type": "done", "status": "ok"},
                {"cell": ["not", "an", "id"], "seq": 1, "type": "stream", "name": "stdout", "text": "?\n"},
                {"error": "refused", "cell_id": {"not": "an id"}},
                {"cell": "awaiting", "seq": 2, "type": "stream", "name": "stdout", "text": "answered\n"},
                {"cell": "awaiting", "seq": 3, "type": "done", "status": "ok"}]
    process, awaiting, comm = ScriptedProcess(respond), Recorder(), Recorder()
    channel = await open_channel(process, awaiting)
    first = asyncio.create_task(run(channel, awaiting, "awaiting"))
    while not awaiting.events:
        await asyncio.sleep(0.01)
    assert (await run(channel, comm, "comm"))["status"] == "ok"
    assert (await first)["status"] == "ok"
    assert awaiting.text() == "waiting\nanswered\n" and comm.text() == "handled\n"
    assert channel.alive
    await channel.close()
