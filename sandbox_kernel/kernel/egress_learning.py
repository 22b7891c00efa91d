"""`%egress learn`: the cells run under the current rules while the destinations they reach
are recorded (host, port, how many connections, which cells); `%egress suggest` turns them
into the narrowest `%egress only` line that allows them.

The destinations come from the provider: the local engine's egress proxy sees every
connection a sandbox makes, pip's included, and keeps a bounded table of them (a local
engine extension, api SandboxClient.egress_destinations). `learn` clears that table; after
each cell the kernel reads it and charges what grew to that cell (a connection made between
cells, by a background thread, goes to the next cell). CreateOS reports no such thing: there
`learn` says so and records nothing. The engine's table and this one hold at most
MAX_DESTINATIONS distinct (host, port) each; past that the cell says once that more were
not recorded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sandbox_kernel.api import EgressDestinations, egress_rules
from sandbox_kernel.kernel.output import CellOutput
from sandbox_kernel.sandbox.session import SandboxSession

MAX_DESTINATIONS = 1000  # distinct (host, port) this kernel keeps, whatever the provider sends
CELLS_NAMED = 5  # cells named per destination (the first ones that reached it)
UNSUPPORTED = ("%egress learn: this provider does not report the destinations a sandbox reaches "
               "(the local engine does); nothing is recorded")


@dataclass
class Reached:
    connections: int = 0
    cells: list[int] = field(default_factory=list)


class LearningNotSupported(Exception):
    """The provider keeps no table of destinations (CreateOS)."""


class EgressLearning:
    """One kernel's learning: on for at most one sandbox at a time, its table kept after --stop
    for `%egress suggest`."""

    def __init__(self) -> None:
        self.sandbox_id: str | None = None  # the sandbox being learned; None: not learning
        self.table: dict[tuple[str, int], Reached] = {}
        self._totals: dict[tuple[str, int], int] = {}  # the provider's counts at the last look
        self.capped = False  # the cap was reached (said once)

    async def start(self, session: SandboxSession) -> None:
        if (await session.get_egress()).denied_count is None:  # the local engine's extension is absent
            raise LearningNotSupported(UNSUPPORTED)
        await session.egress_destinations(clear=True)
        self.sandbox_id = session.sandbox_id
        self.table, self._totals, self.capped = {}, {}, False

    def stop(self) -> None:
        self.sandbox_id = None

    def learning(self, sandbox_id: str | None) -> bool:
        return sandbox_id is not None and sandbox_id == self.sandbox_id

    async def after_cell(self, session: SandboxSession, cell: int, out: CellOutput) -> None:
        """Charge what the sandbox reached since the last look to `cell`."""
        self.take(await session.egress_destinations(), cell, out)

    def take(self, seen: EgressDestinations, cell: int, out: CellOutput) -> None:
        full = bool(seen.dropped)
        for destination in seen.destinations:
            key = (destination.host, destination.port)
            total = destination.allowed + destination.refused
            grew = total - self._totals.get(key, 0)
            if grew <= 0:
                continue
            reached = self.table.get(key)
            if reached is None:
                if len(self.table) >= MAX_DESTINATIONS:
                    full = True
                    continue
                reached = self.table[key] = Reached()
            self._totals[key] = total
            reached.connections += grew
            if cell not in reached.cells and len(reached.cells) < CELLS_NAMED:
                reached.cells.append(cell)
        if full and not self.capped:
            self.capped = True
            out.text(f"sandbox-kernel: %egress learn records at most {min(seen.cap, MAX_DESTINATIONS)} "
                     "destinations: the sandbox reached more, which are not recorded\n", name="stderr")

    def rows(self) -> list[tuple[str, ...]]:
        """The table for `%egress learn` output: destination, connections, cells."""
        return [(destination_rule(host, port) or f"{host}:{port}", str(reached.connections),
                 "cell " + ", ".join(str(cell) for cell in reached.cells))
                for (host, port), reached in self.table.items()]


def destination_rule(host: str, port: int) -> str | None:
    """The rule that allows exactly this destination (the name or address asked for, at this
    port), or None where no rule spells it (a name with an underscore, which the proxy
    passes but rules do not accept)."""
    text = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        rule = egress_rules.parse(text)
    except egress_rules.EgressRuleError:
        return None
    return str(rule) if rule.kind in ("host", "ip") else None


def suggested_rules(destinations: list[tuple[str, int]]) -> tuple[list[str], list[str]]:
    """The narrowest rules allowing every destination (exact host:port each, in the order
    they were first seen), and the destinations no rule can spell."""
    rules: list[str] = []
    unspellable: list[str] = []
    for host, port in destinations:
        rule = destination_rule(host, port)
        if rule is None:
            unspellable.append(f"{host}:{port}")
        elif rule not in rules:
            rules.append(rule)
    return rules, unspellable
