"""Every sandbox of a provider as `sandbox-kernel ls` and the Sandboxes panel show it: its
name, who is responsible for it, its age and what it costs (on CreateOS, or would cost)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

from sandbox_kernel.api import SandboxView, names
from sandbox_kernel.api.models import parse_rfc3339
from sandbox_kernel.sandbox import ownership, pool
from sandbox_kernel.sandbox.cost import Cost, Meter


@dataclass(frozen=True)
class Listed:
    view: SandboxView
    name: str  # the display name (names.py)
    owner: ownership.Owner | None  # None: a warm pool member, waiting for a kernel
    cost: Cost  # so far
    per_hour: float  # USD per hour in its present state

    @property
    def owner_text(self) -> str:
        return "warm pool" if self.owner is None else str(self.owner)


def listing(views: list[SandboxView], meter: Meter | None = None) -> list[Listed]:
    meter = meter or Meter()
    pooled = pool.all_members()
    rows = []
    for view in views:
        meter.observe(view)
        owner = None if view.id in pooled else ownership.owner_of(view.id, view.name)
        rows.append(Listed(view, names.display_name(view), owner, meter.cost(view.id),
                           meter.prices.hourly(view)))
    return rows


def describe_age(created_at: str | None, now: datetime | None = None) -> str:
    created = parse_rfc3339(created_at)
    if created is None:
        return "?"
    return describe_seconds(((now or datetime.now(timezone.utc)) - created).total_seconds())


def describe_seconds(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"
