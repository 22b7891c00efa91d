"""The runner's output funnel (guest/runner/output.py) without a daemon: when explicitly
flushed text goes, on a clock the test moves."""

from __future__ import annotations

import json

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
