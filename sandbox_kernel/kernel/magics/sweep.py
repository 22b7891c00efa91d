"""%sandbox sweep: one cell's code run in a fork of this sandbox per combination of parameter
values, several at once (sandbox/sweep.py forks, runs and destroys); the answer is a table of
each branch's result, the value of the code's last expression or its error, in one line."""

from __future__ import annotations

import argparse
import os
import uuid
from typing import Any

from sandbox_kernel.api import SandboxView
from sandbox_kernel.guest import protocol
from sandbox_kernel.kernel.magics.family import MagicFamily
from sandbox_kernel.kernel.magics.parsing import MagicError
from sandbox_kernel.kernel.magics.tables import table
from sandbox_kernel.kernel.progress_widget import count_progress
from sandbox_kernel.sandbox.session import SandboxSession
from sandbox_kernel.sandbox.sweep import FAILED, OK, Branch, Outcome, SweepError, combinations, grid_of, parameter_source, sweep

RESULT_WIDTH = 200  # characters of a branch's result in the table (it is the sandbox's text)


class SweepMagics(MagicFamily):
    async def sweep(self, args: argparse.Namespace) -> None:
        code = args.code
        if not code or not code.strip():
            raise MagicError("%sandbox sweep: give the code after --: %sandbox sweep -p NAME VALUE ... -- CODE")
        try:
            branches = combinations(grid_of(args.parameters or []))
        except SweepError as exc:
            raise MagicError(f"%sandbox sweep: {exc}") from None
        jobs = args.jobs or min(len(branches), os.cpu_count() or 1)
        done = failed = 0
        progress = count_progress(self.out, self.output_filter,
                                  f"Sweeping {len(branches)} branch(es) over forks of {self.session.sandbox_id}",
                                  len(branches))

        def counted(outcome: Outcome) -> None:
            nonlocal done, failed
            done += 1
            failed += outcome.status == FAILED
            progress.count(done, failed)

        async def run_branch(branch: Branch, fork: SandboxView) -> Outcome:
            return await self._run_branch(branch, fork, code)

        outcome_line: str | None = None  # interrupted: the progress stays as it stood
        try:
            outcomes = await sweep(self.session, branches, run_branch, jobs, on_outcome=counted, keep=args.keep)
            kept = [outcome.sandbox_id for outcome in outcomes if args.keep and outcome.sandbox_id]
            for sandbox_id in kept:
                self.session.keep(sandbox_id)
            outcome_line = (f"Swept {len(branches)} branch(es) over forks of {self.session.sandbox_id}"
                            + (f"; kept {', '.join(kept)}" if kept else "; every fork destroyed"))
        finally:
            progress.end(outcome_line)
        header = ("parameters", "status", "result", *(("kept sandbox",) if kept else ()))
        self.out.display(table([header, *(
            (outcome.branch.label, outcome.status, one_line(outcome.collected.get("result") or outcome.error or ""),
             *((outcome.sandbox_id or "",) if kept else ()))
            for outcome in outcomes)]))

    async def _run_branch(self, branch: Branch, fork: SandboxView, code: str) -> Outcome:
        """The code in the fork, after its values: a session attached to the fork follows the
        source's Python state (the fork's runner is the source's, copied)."""
        result: list[str] = []
        error: list[str] = []

        async def collect(event: dict[str, Any]) -> None:
            kind = event.get(protocol.TYPE)
            if kind == protocol.EXECUTE_RESULT and isinstance(event.get("data"), dict):
                result[:] = [str(event["data"].get("text/plain", ""))[:RESULT_WIDTH * 2]]
            elif kind == protocol.ERROR_EVENT:
                error[:] = [f"{event.get('ename', 'Error')}: {event.get('evalue', '')}"[:RESULT_WIDTH * 2]]

        branch_session = SandboxSession(self.session.settings, refill_pool=False)
        try:
            await branch_session.start(attach_to=fork.id, fresh_runner=False)
            await branch_session.run_cell(uuid.uuid4().hex, parameter_source(branch.parameters) + code, collect,
                                          store_history=False)
        finally:
            await branch_session.release()
        if error:
            return Outcome(branch, FAILED, error=error[0])
        return Outcome(branch, OK, collected={"result": result[0] if result else ""})


def one_line(text: str) -> str:
    """A branch's result on one line of the table, printable characters only, bounded."""
    flat = " ".join("".join(ch if ch.isprintable() else " " for ch in text).split())
    return flat if len(flat) <= RESULT_WIDTH else flat[:RESULT_WIDTH - 1] + "…"
