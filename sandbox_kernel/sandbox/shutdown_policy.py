"""What a kernel's shutdown does to every sandbox it owns (ownership.py), not only the one
it drives: destroy, pause or keep them per the policy, hand a sandbox another live kernel
drives over to that kernel, and find the sandbox of a create still in flight by its name.
What is kept is returned, for the kernel's last words (id, name, state, price per hour).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sandbox_kernel.api import names
from sandbox_kernel.sandbox import ownership
from sandbox_kernel.api import NotFoundError, SandboxAPIError, SandboxClient, SandboxStatus, SandboxView
from sandbox_kernel.sandbox.cost import PriceBook

log = logging.getLogger("sandbox_kernel.sandbox.shutdown_policy")


@dataclass(frozen=True)
class Kept:
    sandbox_id: str
    name: str
    state: str
    per_hour: float  # USD on CreateOS prices, in the state it was left in


def hourly(view: SandboxView, prices: PriceBook, state: SandboxStatus) -> float:
    """What the sandbox costs per hour on CreateOS in `state` (memory and disk while paused)."""
    running = state in (SandboxStatus.RUNNING, SandboxStatus.RESUMING)
    return ((view.vcpu * prices.vcpu_hour if running else 0.0)
            + view.mem_mib / 1024 * prices.memory_gib_hour
            + view.disk_mib * 1024 * 1024 / 1e9 * prices.storage_gb_hour)


async def adopt_unfinished_creates(client: SandboxClient) -> None:
    """Creates this kernel began and has no id for (it is shutting down while its sandbox
    starts): the sandboxes that already exist under those names become owned, so the
    policy reaches them. One still in flight or `creating` keeps its trace for `gc`."""
    pending = ownership.creating_here()
    if not pending:
        return
    for view in await client.list_sandboxes():
        # One still `creating` is left to its trace: destroying it half-made races the create.
        if view.name in pending and view.status not in (*names.GONE, SandboxStatus.CREATING):
            ownership.created(view.name, view.id)


async def apply_policy(client: SandboxClient, policy: str, prices: PriceBook,
                       kept_before: list[str]) -> list[Kept]:
    """Destroy, pause or keep all this kernel owns; return what stays of it and of
    `kept_before` (what the user kept with `%sandbox keep`)."""
    try:
        await adopt_unfinished_creates(client)
    except SandboxAPIError as exc:
        log.warning("shutdown: could not look for sandboxes still being created: %s", exc)
    kept: list[Kept] = []
    for sandbox_id in kept_before:
        try:
            view = await client.get_sandbox(sandbox_id)
        except SandboxAPIError:  # destroyed since, or unknown: nothing to report
            continue
        if view.status not in names.GONE:
            kept.append(Kept(sandbox_id, names.display_name(view), view.status.value,
                             hourly(view, prices, view.status)))
    for sandbox_id in ownership.owned_here():
        elsewhere = ownership.driven_elsewhere(sandbox_id)
        if elsewhere is not None and policy == "destroy":
            ownership.hand_over(sandbox_id, elsewhere)
            continue  # another notebook drives it: now that kernel's to clean up
        try:
            view = await client.get_sandbox(sandbox_id)
            if view.status in names.GONE:
                ownership.forget(sandbox_id)
            elif policy == "destroy":
                await client.delete_sandbox(sandbox_id)
                ownership.forget(sandbox_id)
            else:
                state = view.status
                if policy == "pause" and state == SandboxStatus.RUNNING and elsewhere is None:
                    await client.pause_sandbox(sandbox_id)
                    state = SandboxStatus.PAUSED
                ownership.keep(sandbox_id)
                kept.append(Kept(sandbox_id, names.display_name(view), state.value, hourly(view, prices, state)))
        except NotFoundError:
            ownership.forget(sandbox_id)
        except SandboxAPIError as exc:  # left owned by this (then dead) kernel: gc finds it
            log.warning("shutdown: sandbox %s: %s", sandbox_id, exc)
    return kept


def farewell(kept: list[Kept]) -> str:
    """The kernel's last words: what outlives the notebook and what it costs."""
    if not kept:
        return ""
    lines = [f"Kept after this notebook: {item.sandbox_id} ({item.name}), {item.state}, "
             f"${item.per_hour:.4f}/hour on CreateOS; `sandbox-kernel rm {item.sandbox_id}` destroys it"
             for item in kept]
    return "\n".join(lines) + "\n"
