"""`%sandbox COMMAND --help` and `%egress COMMAND --help` print that command's help, on the
host, before anything reaches the session (so no sandbox is needed here)."""

from __future__ import annotations

from typing import Any

import pytest

from sandbox_kernel.kernel.magics.dispatch import SandboxMagics
from sandbox_kernel.kernel.magics.egress import EGRESS_HELP
from sandbox_kernel.kernel.magics.parsing import HELP
from sandbox_kernel.kernel.output import CellOutput


async def printed(line: str) -> str:
    sent: list[tuple[str, dict[str, Any]]] = []
    magics = SandboxMagics(session=None, out=CellOutput(lambda kind, content: sent.append((kind, content))))  # type: ignore[arg-type]
    await magics.run(line)
    return "".join(content["text"] for kind, content in sent if kind == "stream")


@pytest.mark.parametrize("line", ["%sandbox --help", "%sandbox -h", "%sandbox help"])
async def test_whole_help(line: str) -> None:
    assert await printed(line) == HELP


async def test_one_command() -> None:
    fork = await printed("%sandbox fork --help")
    assert fork.startswith("  %sandbox fork [--name N] [--switch]\n") and "--switch makes" in fork
    assert "%sandbox attach ID" not in fork
    # A required argument missing does not get in the way of asking for help.
    assert (await printed("%sandbox attach -h")).startswith("  %sandbox attach ID|NAME [--destroy-previous]")
    assert await printed("%sandbox on-shutdown --help") == (
        "  %sandbox on-shutdown destroy|pause|keep\n"
        "                                  what closing this notebook does to its sandboxes (the ones\n"
        "                                  it created or forked and did not keep)\n")


async def test_egress_help() -> None:
    assert await printed("%egress --help") == EGRESS_HELP
    assert await printed("%egress only --help") == "  %egress only RULE...            replace all rules with these\n"
    assert await printed("%egress frobnicate --help") == EGRESS_HELP  # unknown: the whole text
