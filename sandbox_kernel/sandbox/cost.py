"""What sandboxes cost on CreateOS: the price book, and a meter of running and paused time.

CreateOS bills vCPU while a sandbox runs, memory while it runs or is paused, and storage
for as long as it exists; egress is free within 50 GiB per sandbox. The meter learns each
sandbox's history from the views the kernel fetches (running_at, paused_at,
last_resumed_at, destroyed_at) and from what the kernel itself did, and prices it. For a
local sandbox the same figures say what it would cost on CreateOS.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from sandbox_kernel.api import SandboxView
from sandbox_kernel.api.models import parse_rfc3339

HOUR = 3600.0
MIB = 1024 * 1024
GB = 1000 ** 3  # storage is priced per GB (10^9 bytes); memory per GiB


@dataclass(frozen=True)
class PriceBook:
    """USD rates; each can be overridden with SANDBOX_KERNEL_PRICE_<NAME>."""

    vcpu_hour: float = 0.03616363  # per vCPU-hour while running
    memory_gib_hour: float = 0.01159025  # per GiB-hour while running or paused
    storage_gb_hour: float = 0.0001584  # per GB-hour of disk while the sandbox exists
    free_egress_gib: float = 50.0  # no egress fees below this, per sandbox
    dated: str = "2026-10-17"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PriceBook:
        env = os.environ if env is None else env
        book = cls()
        changes = {name: float(env[f"SANDBOX_KERNEL_PRICE_{name.upper()}"])
                   for name in ("vcpu_hour", "memory_gib_hour", "storage_gb_hour")
                   if env.get(f"SANDBOX_KERNEL_PRICE_{name.upper()}")}
        return replace(book, **changes, dated="overridden") if changes else book

    def hourly(self, view: SandboxView) -> float:
        """What the sandbox costs per hour in its present state (USD): vCPU only while it
        runs, memory and disk while it exists; nothing once it is gone."""
        if view.status.is_gone:
            return 0.0
        rate = view.mem_mib / 1024 * self.memory_gib_hour + view.disk_mib * MIB / GB * self.storage_gb_hour
        return rate if view.status.is_pause_like else rate + float(view.vcpu) * self.vcpu_hour


@dataclass(frozen=True)
class Cost:
    sandbox_id: str
    running_seconds: float
    paused_seconds: float
    vcpu: float  # USD
    memory_running: float
    memory_paused: float
    storage: float

    @property
    def total(self) -> float:
        return self.vcpu + self.memory_running + self.memory_paused + self.storage


@dataclass
class _History:
    """A sandbox's size and its state changes, (unix time, running | paused | gone), in order."""

    vcpu: float
    mem_mib: int
    disk_mib: int
    changes: list[tuple[float, str]] = field(default_factory=list)

    def note(self, at: float | None, state: str) -> None:
        if at is None or (at, state) in self.changes:
            return
        self.changes.append((at, state))
        self.changes.sort()

    def seconds(self, now: float) -> tuple[float, float]:
        """(running, paused) seconds from the first change until now or the end."""
        running = paused = 0.0
        for (start, state), (end, _) in zip(self.changes, [*self.changes[1:], (now, "now")]):
            span = max(0.0, min(end, now) - start)
            if state == "running":
                running += span
            elif state == "paused":
                paused += span
            if state == "gone":
                break
        return running, paused


def unix_time(stamp: str | None) -> float | None:
    parsed = parse_rfc3339(stamp)
    return parsed.timestamp() if parsed else None


class Meter:
    def __init__(self, prices: PriceBook | None = None) -> None:
        self.prices = prices or PriceBook.from_env()
        self.histories: dict[str, _History] = {}

    def observe(self, view: SandboxView) -> None:
        """Learn from a sandbox's view: its size and the state changes it records."""
        history = self.histories.setdefault(view.id, _History(view.vcpu, view.mem_mib, view.disk_mib))
        history.note(unix_time(view.running_at) or unix_time(view.created_at), "running")
        history.note(unix_time(view.paused_at), "paused")
        history.note(unix_time(view.last_resumed_at), "running")
        history.note(unix_time(view.destroyed_at), "gone")

    def note_gone(self, sandbox_id: str, at: float | None = None) -> None:
        """The kernel destroyed it (CreateOS may answer 404 afterwards, with no destroyed_at)."""
        if sandbox_id in self.histories:
            self.histories[sandbox_id].note(at if at is not None else time.time(), "gone")

    def cost(self, sandbox_id: str, now: float | None = None) -> Cost:
        history = self.histories[sandbox_id]
        running, paused = history.seconds(time.time() if now is None else now)
        memory_gib = history.mem_mib / 1024
        disk_gb = history.disk_mib * MIB / GB
        book = self.prices
        return Cost(sandbox_id, running, paused,
                    vcpu=running / HOUR * history.vcpu * book.vcpu_hour,
                    memory_running=running / HOUR * memory_gib * book.memory_gib_hour,
                    memory_paused=paused / HOUR * memory_gib * book.memory_gib_hour,
                    storage=(running + paused) / HOUR * disk_gb * book.storage_gb_hour)
