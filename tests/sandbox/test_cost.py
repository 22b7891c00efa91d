"""The cost meter against figures worked out by hand (CreateOS prices of 2026-10-17)."""

from __future__ import annotations

import pytest

from sandbox_kernel.api import SandboxStatus, SandboxView
from sandbox_kernel.sandbox.cost import Meter, PriceBook

T0 = "2026-11-01T10:00:00Z"
T0_UNIX = 1793527200.0  # 2026-11-01T10:00:00Z
HOUR = 3600.0


def view(sandbox_id: str, status: str, vcpu: int = 1, mem_mib: int = 1024, **stamps: str) -> SandboxView:
    return SandboxView(id=sandbox_id, status=SandboxStatus(status), vcpu=vcpu, mem_mib=mem_mib,
                       disk_mib=10240, created_at=stamps.pop("created_at", T0), ingress_enabled=False, **stamps)


def test_running_then_paused_then_running_again() -> None:
    meter = Meter(PriceBook())
    meter.observe(view("sb-a", "running", running_at=T0))
    meter.observe(view("sb-a", "paused", running_at=T0, paused_at="2026-11-01T12:00:00Z"))
    meter.observe(view("sb-a", "running", running_at=T0, paused_at="2026-11-01T12:00:00Z",
                       last_resumed_at="2026-11-01T13:00:00.000000000Z"))
    meter.observe(view("sb-a", "running", running_at=T0, paused_at="2026-11-01T12:00:00Z",
                       last_resumed_at="2026-11-01T13:00:00Z"))  # seen again: counted once
    cost = meter.cost("sb-a", now=T0_UNIX + 3.5 * HOUR)
    assert (cost.running_seconds, cost.paused_seconds) == (2.5 * HOUR, 1 * HOUR)
    # 2.5 h x 1 vCPU x 0.03616363
    assert cost.vcpu == pytest.approx(0.090409075)
    # 2.5 GiB-h running and 1 GiB-h paused x 0.01159025
    assert cost.memory_running == pytest.approx(0.028975625)
    assert cost.memory_paused == pytest.approx(0.01159025)
    # 10240 MiB = 10.73741824 GB, for 3.5 h, x 0.0001584
    assert cost.storage == pytest.approx(0.00595282467)
    assert cost.total == pytest.approx(0.13692777467)


def test_a_fork_is_billed_on_its_own_until_destroyed() -> None:
    meter = Meter(PriceBook())
    meter.observe(view("sb-fork", "running", vcpu=2, mem_mib=4096, created_at="2026-11-01T11:00:00Z",
                       running_at="2026-11-01T11:00:00Z", forked_from="sb-a"))
    meter.note_gone("sb-fork", at=T0_UNIX + 2 * HOUR)
    cost = meter.cost("sb-fork", now=T0_UNIX + 10 * HOUR)  # the clock stopped at destruction
    assert (cost.running_seconds, cost.paused_seconds) == (1 * HOUR, 0.0)
    # 1 h x (2 x 0.03616363 + 4 x 0.01159025) + 1 h x 10.73741824 x 0.0001584
    assert cost.vcpu == pytest.approx(0.07232726)
    assert cost.memory_running == pytest.approx(0.046361)
    assert cost.total == pytest.approx(0.07232726 + 0.046361 + 0.001700807049)


def test_destroyed_at_from_the_server_stops_the_clock() -> None:
    meter = Meter(PriceBook())
    meter.observe(view("sb-b", "destroyed", running_at=T0, paused_at="2026-11-01T10:30:00Z",
                       destroyed_at="2026-11-01T11:00:00Z"))
    cost = meter.cost("sb-b", now=T0_UNIX + 5 * HOUR)
    assert (cost.running_seconds, cost.paused_seconds) == (0.5 * HOUR, 0.5 * HOUR)
    assert cost.vcpu == pytest.approx(0.5 * 0.03616363)
    assert cost.memory_running + cost.memory_paused == pytest.approx(1 * 0.01159025)


def test_prices_can_be_overridden() -> None:
    book = PriceBook.from_env({"SANDBOX_KERNEL_PRICE_VCPU_HOUR": "1.0"})
    assert (book.vcpu_hour, book.memory_gib_hour, book.dated) == (1.0, 0.01159025, "overridden")
    assert PriceBook.from_env({}) == PriceBook()
    meter = Meter(book)
    meter.observe(view("sb-c", "running", running_at=T0))
    assert meter.cost("sb-c", now=T0_UNIX + 2 * HOUR).vcpu == pytest.approx(2.0)
