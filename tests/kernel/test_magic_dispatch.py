"""Each %sandbox and %egress subcommand the parsers accept has its handler in a magic family,
and no handler is left without a command (kernel/magics/dispatch.py)."""

from __future__ import annotations

import argparse
from typing import Any

from sandbox_kernel.kernel.magics.dispatch import SandboxMagics
from sandbox_kernel.kernel.magics.egress import EGRESS_PARSER
from sandbox_kernel.kernel.magics.parsing import PARSER
from sandbox_kernel.kernel.output import CellOutput


def subcommands(parser: argparse.ArgumentParser) -> set[str]:
    actions = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    return set(actions[0].choices)


def test_every_subcommand_has_its_handler() -> None:
    sent: list[tuple[str, dict[str, Any]]] = []
    magics = SandboxMagics(session=None, out=CellOutput(lambda kind, content: sent.append((kind, content))))  # type: ignore[arg-type]
    assert set(magics.sandbox_commands) == subcommands(PARSER)
    assert set(magics.egress_commands) == subcommands(EGRESS_PARSER)
