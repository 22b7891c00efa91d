"""After a cell's code: name the connections the sandbox's egress rules refused meanwhile,
whatever the client (its own message is at best '403 Forbidden'), at the cost of no request
for a cell without refusals where the engine's stream tells their count."""

from __future__ import annotations

import asyncio
import logging

from sandbox_kernel.kernel.output import CellOutput
from sandbox_kernel.sandbox.session import SandboxSession

log = logging.getLogger("sandbox_kernel.kernel.egress_refusals")


class RefusalNotes:
    def __init__(self) -> None:
        # Per sandbox, how many connections its egress rules had refused at the end of the last
        # cell; None where the provider does not count them (CreateOS). See name_new.
        self.seen: dict[str, int | None] = {}
        # Per sandbox, the engine stream's count of refusals when `seen` was taken.
        self.hinted: dict[str, int | None] = {}
        # Per sandbox, its count being taken ahead of its first cell (count_ahead).
        self._ahead: dict[str, asyncio.Task[None]] = {}

    def counted(self, sandbox_id: str) -> bool:
        return sandbox_id in self.seen

    def count_ahead(self, session: SandboxSession, sandbox_id: str) -> None:
        """Take a sandbox's starting count now, in the background: its sandbox has just
        started, and the frontend has yet to send a cell (the first waits ~0.2 s for IOPub
        to settle). That cell then need not wait for the request, a round trip to a remote
        service; `count` takes what this got, or asks again if it failed."""
        if sandbox_id not in self.seen and sandbox_id not in self._ahead:
            self._ahead[sandbox_id] = asyncio.get_running_loop().create_task(self._count_quietly(session, sandbox_id))

    async def _count_quietly(self, session: SandboxSession, sandbox_id: str) -> None:
        try:
            await self._take_count(session, sandbox_id)
        except Exception as exc:  # the first cell asks again and says why, if it fails again
            log.warning("could not count the egress refusals ahead of the first cell: %s", exc)

    async def count(self, session: SandboxSession, sandbox_id: str) -> None:
        """The count a sandbox's first cell starts from (an attached one has refusals already)."""
        ahead = self._ahead.pop(sandbox_id, None)
        if ahead is not None:
            await ahead
        if not self.counted(sandbox_id):
            await self._take_count(session, sandbox_id)

    async def _take_count(self, session: SandboxSession, sandbox_id: str) -> None:
        self.hinted[sandbox_id] = session.egress_refusals_hint()
        self.seen[sandbox_id] = (await session.get_egress()).denied_count

    def may_have_changed(self, session: SandboxSession, sandbox_id: str) -> bool:
        """Whether to ask the engine for refusals after a cell. Never where the provider does
        not count them (CreateOS: its first answer said so). The local engine's stream tells
        the count ahead of a cell's output (local/processes.py), so a cell without refusals
        costs no request; without that word (no channel), one GET a cell (~1.3 ms locally,
        a round trip to a remote engine)."""
        if self.seen.get(sandbox_id) is None:
            return False
        hint = session.egress_refusals_hint()
        return hint is None or hint != self.hinted.get(sandbox_id)

    async def name_new(self, session: SandboxSession, sandbox_id: str, out: CellOutput) -> None:
        """Name the refusals since the last count in the cell's output."""
        hint = session.egress_refusals_hint()
        view = await session.get_egress()
        before, self.seen[sandbox_id] = self.seen[sandbox_id], view.denied_count
        self.hinted[sandbox_id] = hint
        if before is not None and view.denied_count is not None:
            # The %egress magic's module, imported with the first refusal, not at start.
            from sandbox_kernel.kernel.magics.egress import show_refusals

            show_refusals(out, view, before)
