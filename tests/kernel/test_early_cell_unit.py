"""EarlyCell (kernel/early_cell.py) on its own: what it holds until taken over, in what order
it hands that on, and what a refused or dropped run leaves. The whole way, from a frontend's
request to the sandbox and back: tests/e2e/test_early_cell.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from sandbox_kernel.api import ConflictError
from sandbox_kernel.kernel import early_cell
from sandbox_kernel.kernel.early_cell import EarlyCell, EarlyCells


def cell() -> EarlyCell:
    return EarlyCell([], "msg-1", "print(1)", 1, store_history=True, allow_stdin=False)


async def test_events_held_until_taken_over_then_in_order_with_later_ones() -> None:
    early = cell()
    done: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
    early.run = asyncio.ensure_future(done)
    await early.on_event({"n": 1})
    assert early.delivered.is_set()  # an event of the cell: the runner has it
    await early.on_event({"n": 2})
    seen: list[int] = []

    async def handler(event: dict[str, Any]) -> None:
        seen.append(event["n"])
        if event["n"] == 1:  # an event that comes while the held ones are handed on
            await early.on_event({"n": 3})

    taking = asyncio.ensure_future(early.result(handler))
    await asyncio.sleep(0)
    assert seen == [1, 2, 3]
    await early.on_event({"n": 4})
    assert seen == [1, 2, 3, 4]
    done.set_result({"type": "done"})
    assert await taking == {"type": "done"}


async def test_a_refused_run_is_none_and_nothing_was_held() -> None:
    early = cell()

    async def refused() -> dict[str, Any]:
        raise ConflictError("sandbox is paused")

    early.run = asyncio.ensure_future(refused())
    seen: list[dict[str, Any]] = []

    async def handler(event: dict[str, Any]) -> None:
        seen.append(event)

    assert await early.result(handler) is None
    assert seen == []


async def test_another_failure_of_the_run_is_the_cells() -> None:
    early = cell()

    async def failed() -> dict[str, Any]:
        raise RuntimeError("the runner died")

    early.run = asyncio.ensure_future(failed())

    async def handler(event: dict[str, Any]) -> None:
        raise AssertionError("no event")

    with pytest.raises(RuntimeError, match="the runner died"):
        await early.result(handler)


async def test_a_dropped_cell_holds_nothing_more_and_its_run_is_cancelled() -> None:
    early = cell()
    early.run = asyncio.ensure_future(asyncio.sleep(10))
    await early.on_event({"n": 1})
    early.drop()
    await early.on_event({"n": 2})
    assert early._held is None
    await asyncio.sleep(0)
    assert early.run.cancelled()


async def test_the_dispatch_waits_for_the_local_engine_to_hand_the_cell_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """EarlyCells.before_dispatch, with only the kernel's settings (the provider) beside it."""
    monkeypatch.setattr(early_cell, "DISPATCH_WAIT", 60)
    cells = EarlyCells(SimpleNamespace(settings=SimpleNamespace(provider="local")))  # type: ignore[arg-type]
    early = cells.pending = cell()
    waiting = asyncio.ensure_future(cells.before_dispatch(early.frames))
    for _ in range(3):
        await asyncio.sleep(0)
    assert not waiting.done()
    await cells.before_dispatch([])  # another request's frames: no wait
    early.delivered.set()
    await waiting

    monkeypatch.setattr(early_cell, "DISPATCH_WAIT", 0.01)
    never = cells.pending = cell()
    await cells.before_dispatch(never.frames)  # not handed on: the dispatch goes on after the wait
    cells.kernel = SimpleNamespace(settings=SimpleNamespace(provider="createos"))  # type: ignore[assignment]
    monkeypatch.setattr(early_cell, "DISPATCH_WAIT", 60)
    await asyncio.wait_for(cells.before_dispatch(never.frames), 5)  # a remote service: no wait
