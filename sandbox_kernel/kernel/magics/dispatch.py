"""A magic line, read and handed to the command of its family: the line's words (with the
notebook's `{expr}` and `$name` values filled in), help, the argument parser, then the
command's handler."""

from __future__ import annotations

import argparse
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from sandbox_kernel.guest import protocol
from sandbox_kernel.kernel import magic_words
from sandbox_kernel.kernel.egress_learning import EgressLearning
from sandbox_kernel.kernel.magic_words import Word
from sandbox_kernel.kernel.magics.egress import EGRESS_HELP, EGRESS_PARSER, EgressMagics
from sandbox_kernel.kernel.magics.files import FileMagics
from sandbox_kernel.kernel.magics.info import InfoMagics
from sandbox_kernel.kernel.magics.lifecycle import LifecycleMagics
from sandbox_kernel.kernel.magics.parsing import (DOWNLOAD, EGRESS, HELP, MAGIC, PARSER, UPLOAD, MagicError, code_after,
                                                  help_for)
from sandbox_kernel.kernel.magics.sweep import SweepMagics
from sandbox_kernel.kernel.output import CellOutput
from sandbox_kernel.kernel.output_safety import OutputFilter
from sandbox_kernel.sandbox.session import SandboxSession

Command = Callable[[argparse.Namespace], Awaitable[None]]


class SandboxMagics:
    """The magics of one cell: each line is run with `run`, in the cell's order."""

    def __init__(self, session: SandboxSession, out: CellOutput, output_filter: OutputFilter | None = None,
                 learning: EgressLearning | None = None) -> None:
        self.session = session
        self.out = out
        self.output_filter = output_filter or OutputFilter()
        self.payload: list[dict[str, Any]] = []  # set_next_input, for the cell's execute_reply
        lifecycle = LifecycleMagics(session, out, self.output_filter)
        info = InfoMagics(session, out, self.output_filter, self.payload)
        egress = EgressMagics(session, out, self.output_filter, self.payload, learning or EgressLearning())
        sweeps = SweepMagics(session, out, self.output_filter)
        self.files = FileMagics(session, out, self.output_filter)
        # Each subcommand of PARSER and EGRESS_PARSER, and its handler.
        self.sandbox_commands: dict[str, Command] = {
            "status": info.status, "list": lifecycle.list_sandboxes, "pause": lifecycle.pause,
            "resume": lifecycle.resume, "fork": lifecycle.fork, "attach": lifecycle.attach,
            "keep": lifecycle.keep, "cost": info.cost, "on-shutdown": lifecycle.on_shutdown,
            "trust-output": info.trust_output, "help": info.help, "seal": info.seal,
            "sweep": sweeps.sweep}
        self.egress_commands: dict[str, Command] = {
            "show": egress.show, "allow": egress.allow, "deny": egress.deny, "only": egress.only,
            "block-all": egress.block_all, "open": egress.open_to_all, "help": egress.help,
            "learn": egress.learn, "suggest": egress.suggest}

    async def words(self, prog: str, rest: str) -> list[Word]:
        """The line's words, `{expr}` and `$name` filled in from the notebook's variables as
        IPython does for its magics (`%sandbox attach {child}`), each value kept to the one
        word it was written in (magic_words says why)."""
        try:
            pieces = magic_words.split_words(rest)
            expressions = magic_words.expressions_of(pieces)
            values = await self.values(expressions) if expressions else None
            words = magic_words.fill_in(pieces, values)
            magic_words.check_words(words, has_command=prog in (MAGIC, EGRESS))
        except magic_words.MagicLineError as exc:
            raise MagicError(f"{prog}: {exc}") from None
        return words

    async def values(self, expressions: list[str]) -> dict[str, str] | None:
        """The expressions' values from the sandbox; None where one failed (as in IPython,
        the line is then taken as typed)."""
        printed: list[str] = []
        size = 0

        async def collect(event: dict[str, Any]) -> None:
            nonlocal size
            if event.get(protocol.TYPE) == protocol.STREAM and event.get("name") == "stdout" and size <= magic_words.MAX_ANSWER:
                text = str(event.get("text", ""))
                size += len(text)
                printed.append(text)

        sandbox_id = self.session.sandbox_id
        done = await self.session.run_cell(
            uuid.uuid4().hex, magic_words.VALUES_CODE % {"expressions": expressions}, collect, silent=True,
            store_history=False, on_resume=lambda: self.out.progress(f"Sandbox {sandbox_id} was paused: resuming…"))
        if done.get("status") != "ok":
            return None
        return magic_words.parse_values("".join(printed), expressions)

    async def run(self, line: str) -> None:
        prog = next(name for name in (UPLOAD, DOWNLOAD, EGRESS, MAGIC) if line.startswith(name))
        line, code = code_after(line) if prog == MAGIC else (line, None)
        words = await self.words(prog, line[len(prog):])
        if prog in (UPLOAD, DOWNLOAD):
            await self.files.transfer(prog, words)
            return
        egress = prog == EGRESS
        text = EGRESS_HELP if egress else HELP
        typed = [word.text for word in words]
        asked = help_for(text, prog, typed)
        if asked is not None:
            self.out.text(asked)
            return
        if egress:
            args = EGRESS_PARSER.parse_args(typed)
            await self.egress_commands[args.command or "show"](args)
            return
        args = PARSER.parse_args(typed)
        if code is not None and args.command != "sweep":
            raise MagicError(f"{MAGIC} {args.command or ''}: only sweep takes ' -- CODE' (see {MAGIC} help)")
        args.code = code
        await self.sandbox_commands[args.command or "help"](args)
