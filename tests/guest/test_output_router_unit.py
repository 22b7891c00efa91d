"""The runner's output funnel (guest/runner/output.py) without a daemon: when flushed text
goes, on a clock the test moves, and how the flusher thread treats a line being written."""

from __future__ import annotations

import json
import math
import threading
import time

import pytest

from sandbox_kernel.guest.runner import output
from sandbox_kernel.guest.runner.cells import Cell, OutputBudget
from sandbox_kernel.guest.runner.output import OutputRouter, ParentRequests


class NoFdOutput:
    """Stands in for FdCapture, which would point the test process's own fds 1 and 2 at
    pipes: nothing is ever written to them here."""

    log_fds: dict[str, int] = {}

    def has_output(self) -> bool:
        return False

    def read_available(self) -> list[tuple[str, str]]:
        return []


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def stream_texts(cell: Cell) -> list[str]:
    return [event["text"] for event in map(json.loads, cell.read_after(0, 0)[0])]


def new_cell(msg_id: str = "c1") -> Cell:
    return Cell(msg_id, "", silent=False, store_history=True, execution_count=None, budget=OutputBudget(2**20, 0))


def router_with_flusher() -> OutputRouter:
    """A router whose flusher thread runs (its fd reader does not: there are no fds)."""
    router = OutputRouter(NoFdOutput(), ParentRequests())
    threading.Thread(target=router._flush_forever, daemon=True).start()
    return router


def wait_for_events(cell: Cell, count: int) -> list[str]:
    deadline = time.monotonic() + 30
    while len(texts := stream_texts(cell)) < count and time.monotonic() < deadline:
        time.sleep(0.005)
    return texts


def test_an_empty_flusher_round_does_not_hold_back_the_next_flushed_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """A print loop flushing every 10 ms: the flusher, woken by a line's first write, ends
    its wait after the line's explicit flush sent it. That round sends nothing, so the next
    line, a full interval after the first, goes at once (it used to wait 10 ms more)."""
    clock = Clock()
    monkeypatch.setattr(output.time, "monotonic", clock)
    router = OutputRouter(NoFdOutput(), ParentRequests())  # no threads: the test plays the flusher
    cell = Cell("c1", "", silent=False, store_history=True, execution_count=None,
                budget=OutputBudget(2**20, 0))
    router.begin(cell)
    router.write("stdout", "1\n")
    router.flush_now()
    clock.now += router.FLUSH_INTERVAL * 0.9
    with router._lock:
        router._flush_round()
    clock.now += router.FLUSH_INTERVAL * 0.2
    router.write("stdout", "2\n")
    router.flush_now()
    assert stream_texts(cell) == ["1\n", "2\n"]


def test_a_line_flushed_early_is_due_when_the_interval_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr(output.time, "monotonic", clock)
    router = OutputRouter(NoFdOutput(), ParentRequests())
    cell = Cell("c1", "", silent=False, store_history=True, execution_count=None,
                budget=OutputBudget(2**20, 0))
    router.begin(cell)
    router.write("stdout", "1\n")
    router.flush_now()
    sent = clock.now
    clock.now += router.FLUSH_INTERVAL / 2
    router.write("stdout", "2\n")
    router.flush_now()  # within the interval: left to the flusher...
    assert stream_texts(cell) == ["1\n"]
    assert router._flush_due == sent + router.FLUSH_INTERVAL  # ...for the interval's end
    clock.now = router._flush_due
    with router._lock:
        router._flush_round()
    assert stream_texts(cell) == ["1\n", "2\n"]


def test_a_flush_left_to_the_flusher_does_not_hurry_the_next_cells_first_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """A line flushed early is left to the flusher, then the cell's end sends it before the
    flusher wakes. The explicit flush's due time went with it: left set, it made the next
    cell's first write go at once, cut off from the rest of its line (CI saw a quickstart
    cell's "mean square: 28.5" and its newline as two outputs)."""
    clock = Clock()
    monkeypatch.setattr(output.time, "monotonic", clock)
    router = OutputRouter(NoFdOutput(), ParentRequests())
    first = new_cell("c1")
    router.begin(first)
    router.write("stdout", "1\n")
    router.flush_now()
    clock.now += router.FLUSH_INTERVAL / 2
    router.write("stdout", "2\n")
    router.flush_now()
    router.end(first)
    assert stream_texts(first) == ["1\n", "2\n"]
    assert router._flush_due == math.inf

    clock.now += 1
    second = new_cell("c2")
    router.begin(second)
    router.write("stdout", "mean square: 28.5")
    with router._lock:
        assert router._sending_time(clock.now) > clock.now


def test_text_ending_mid_line_waits_for_its_line_and_a_whole_line_waits_only_the_interval(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr(output.time, "monotonic", clock)
    router = OutputRouter(NoFdOutput(), ParentRequests())
    router.begin(new_cell())
    started = clock.now
    router.write("stdout", "mean square: 28.5")
    with router._lock:
        assert router._sending_time(started) == started + router.LINE_WAIT
    router.write("stdout", "\n")
    with router._lock:
        assert router._sending_time(started) == started + router.FLUSH_INTERVAL
    router.write("stdout", "50%\r")  # a progress line redrawn in place is a line too
    with router._lock:
        assert router._sending_time(started) == started + router.FLUSH_INTERVAL
    router.flush_now()  # sent at once: the first event
    sent = clock.now
    router.write("stdout", "Name: ")
    router.flush_now()  # asked for within the interval: its end, whatever the line
    with router._lock:
        assert router._sending_time(clock.now) == sent + router.FLUSH_INTERVAL


def test_a_print_stalled_between_its_text_and_newline_is_still_one_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flusher thread runs; the stall between a print's two writes is five intervals.
    LINE_WAIT is made long so that no slowness of this machine decides the outcome."""
    monkeypatch.setattr(OutputRouter, "LINE_WAIT", 60.0)
    router = router_with_flusher()
    cell = new_cell()
    router.begin(cell)
    router.write("stdout", "mean square: 28.5")
    time.sleep(5 * router.FLUSH_INTERVAL)
    assert stream_texts(cell) == []
    router.write("stdout", "\n")
    assert wait_for_events(cell, 1) == ["mean square: 28.5\n"]


def test_a_partial_line_goes_out_without_its_newline_once_line_wait_is_over(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(OutputRouter, "LINE_WAIT", 0.05)
    router = router_with_flusher()
    cell = new_cell()
    router.begin(cell)
    router.write("stdout", "working...")
    assert wait_for_events(cell, 1) == ["working..."]
