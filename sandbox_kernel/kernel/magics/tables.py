"""How the magics show their answers: tables (HTML for notebooks, aligned text for the rest),
ages and costs in words."""

from __future__ import annotations

import html
from collections.abc import Sequence

from sandbox_kernel.kernel.output import html_without_math
from sandbox_kernel.sandbox.cost import Cost
from sandbox_kernel.sandbox.listing import describe_age, describe_seconds

__all__ = ["describe_age", "describe_cost", "describe_seconds", "table"]


def describe_cost(cost: Cost) -> str:
    return (f"${cost.total:.4f} (running {describe_seconds(cost.running_seconds)}, "
            f"paused {describe_seconds(cost.paused_seconds)})")


def table(rows: Sequence[tuple[str, ...]]) -> dict[str, str]:
    """A mime bundle: an HTML table for notebooks, aligned text for everything else. The
    first column is the label; a row may have more cells than another (each column is as
    wide as its widest cell that is not the last of its row)."""
    columns = max(len(row) for row in rows)
    widths = [max((len(row[i]) for row in rows if len(row) > i + 1), default=0) for i in range(columns)]
    text = "\n".join("  ".join([*(f"{cell:<{widths[i]}}" for i, cell in enumerate(row[:-1])), row[-1]])
                     for row in rows)

    def last(row: tuple[str, ...]) -> str:  # a short row's last cell spans the columns it lacks
        span = columns - len(row) + 1
        return (f"<td colspan='{span}'>" if span > 1 else "<td>") + f"{html.escape(row[-1])}</td>"

    body = "".join("<tr>" + f"<th style='text-align:left'>{html.escape(row[0])}</th>"
                   + "".join(f"<td>{html.escape(cell)}</td>" for cell in row[1:-1]) + last(row) + "</tr>"
                   for row in rows)
    return {"text/plain": text, "text/html": html_without_math(f"<table>{body}</table>")}
