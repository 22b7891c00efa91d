"""After a cell's code: name the connections the sandbox's egress rules refused meanwhile,
whatever the client (its own message is at best '403 Forbidden'), at the cost of no request
for a cell without refusals where the engine's stream tells their count."""

from __future__ import annotations

from sandbox_kernel.kernel.output import CellOutput
from sandbox_kernel.sandbox.session import SandboxSession


class RefusalNotes:
    def __init__(self) -> None:
        # Per sandbox, how many connections its egress rules had refused at the end of the last
        # cell; None where the provider does not count them (CreateOS). See name_new.
        self.seen: dict[str, int | None] = {}
        # Per sandbox, the engine stream's count of refusals when `seen` was taken.
        self.hinted: dict[str, int | None] = {}

    def counted(self, sandbox_id: str) -> bool:
        return sandbox_id in self.seen

    async def count(self, session: SandboxSession, sandbox_id: str) -> None:
        """The count a sandbox's first cell starts from (an attached one has refusals already)."""
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
