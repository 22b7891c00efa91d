"""One execute_request's cell: split into magic lines (run here, on the host) and code (run in
the sandbox), in order; its reply built from what the runner said. Every execute_request
gets its reply, with one clear line for anything that went wrong outside the user's code."""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from sandbox_kernel.api import SandboxAPIError
from sandbox_kernel.guest import protocol
from sandbox_kernel.kernel.egress_learning import EgressLearning
from sandbox_kernel.kernel.egress_refusals import RefusalNotes
from sandbox_kernel.kernel.events import EventTranslator
from sandbox_kernel.kernel.interrupts import WaitInterrupted
from sandbox_kernel.kernel.magics.parsing import MagicError, Segment, split_cell
from sandbox_kernel.kernel.output import CellOutput
from sandbox_kernel.sandbox.session import RunnerDied, SandboxSession, SessionError

if TYPE_CHECKING:
    from sandbox_kernel.kernel.handlers import SandboxKernel
    from sandbox_kernel.kernel.magics.dispatch import SandboxMagics

log = logging.getLogger("sandbox_kernel.kernel.execute")

# A cell that only leaves (`exit` typed in jupyter console): see CellExecutor.is_paused.
EXIT_CELL = re.compile(r"\s*(exit|quit)(\(\))?\s*")

T = TypeVar("T")


class CellExecutor:
    def __init__(self, kernel: SandboxKernel) -> None:
        self.kernel = kernel
        self.refusals = RefusalNotes()
        self.learning = EgressLearning()  # %egress learn, across cells

    async def execute(self, code: str, silent: bool, store_history: bool,
                      user_expressions: dict[str, Any], allow_stdin: bool) -> dict[str, Any]:
        kernel = self.kernel
        if not code.strip() and not user_expressions:
            return self.ok()
        # A cell that went ahead (early_cell.py) had started before the kernel began to stop.
        if kernel.shutdown.stopping and not kernel.early_cells.went_ahead(kernel.parent_msg_id()):
            return self.fail("KernelStopping", kernel.shutdown.stopping_line())
        if store_history and not silent:
            # At the loop's next turn, which comes once the cell's request is written (SQLite's
            # insert took ~0.2 ms of the way to the sandbox; the first cell's opens the file too).
            asyncio.get_running_loop().call_soon(kernel.record_input, kernel.cell_count(), code)
        out = CellOutput(kernel.send_iopub, in_place=kernel.queries.updates_in_place())
        # Once the sandbox is up there is nothing to wait for, so no interruptible task: its
        # loop turn came before the cell's request, with whatever else was ready to run.
        up = kernel.boot.ready()
        ensure = kernel.boot.ensure_session(out, silent)
        try:
            session = await (ensure if up else kernel.interrupts.interruptible_wait(ensure))
        except SessionError as exc:
            return self.fail("KernelStopping" if kernel.shutdown.stopping else "SandboxUnavailable", str(exc))
        except WaitInterrupted:
            return self.fail("KeyboardInterrupt", "interrupted: the sandbox is still starting; "
                             "run a cell when you want it")
        if self.exit_cell(code) and await self._best_effort(self.is_paused(session)):
            return self.ok([{"source": "ask_exit", "keepkernel": False}])
        magics: SandboxMagics | None = None  # made for a cell's first magic line
        payload: list[dict[str, Any]] = []
        segments = split_cell(code)
        # user_expressions are evaluated after the cell's last code, in the sandbox; after a
        # final host magic (or for an empty cell), by a silent empty run.
        last_code = max((i for i, segment in enumerate(segments) if not segment.magic), default=None)
        if user_expressions and (last_code is None or last_code < len(segments) - 1):
            segments.append(Segment(text="", magic=False))
            last_code = len(segments) - 1
        expressions: dict[str, Any] = {}
        for index, segment in enumerate(segments):
            if segment.magic:
                if magics is None:
                    # Imported here: the magics' modules (sweeps, transfers, costs, sealed
                    # notebooks...) are not needed for a first cell, only for one with a magic.
                    from sandbox_kernel.kernel.magics import dispatch

                    magics = dispatch.SandboxMagics(session, out, kernel.output_filter, self.learning)
                try:
                    await kernel.interrupts.interruptible_wait(magics.run(segment.text))
                    payload += magics.payload
                    magics.payload.clear()
                except (MagicError, SessionError) as exc:
                    return self.fail("MagicError", str(exc))
                except SandboxAPIError as exc:
                    return self.fail("SandboxError", exc.user_message())
                except WaitInterrupted:
                    return self.fail("KeyboardInterrupt", "interrupted: stopped waiting, but the sandbox "
                                     "service carries on; `%sandbox status` and `%sandbox list` show "
                                     "where it got to")
                continue
            # A silent execution (a frontend's own) shows nothing: its refusals go with the next cell.
            sandbox_id = None if silent else session.sandbox_id
            if sandbox_id is not None and not self.refusals.counted(sandbox_id):
                await self._best_effort(self.refusals.count(session, sandbox_id))
            fields: dict[str, Any] = {"allow_stdin": allow_stdin, "parent_msg_id": kernel.parent_msg_id()}
            if kernel.subshell_id() is not None:
                fields[protocol.SUBSHELL_ID] = kernel.subshell_id()
            if index == last_code and user_expressions:
                fields["user_expressions"] = user_expressions
            reply = await self._run_code(session, segment.text, silent or not segment.text,
                                         store_history and bool(segment.text), out, fields)
            if sandbox_id is not None and self.refusals.may_have_changed(session, sandbox_id):
                await self._best_effort(self.refusals.name_new(session, sandbox_id, out))
            if self.learning.learning(sandbox_id):
                await self._best_effort(self.learning.after_cell(session, kernel.cell_count(), out))
            if reply["status"] != "ok":
                return reply
            payload += reply["payload"]
            expressions = reply["user_expressions"]
        return self.ok(payload, expressions)

    @staticmethod
    def exit_cell(code: str) -> bool:
        return EXIT_CELL.fullmatch(code) is not None

    @staticmethod
    async def is_paused(session: SandboxSession) -> bool:
        """Whether `exit` can end the frontend's session without running: waking a paused
        sandbox (or one on its way, SandboxStatus.is_pause_like: seconds, and its running price)
        only to leave it helps nobody. One request, for such cells only."""
        return (await session.view()).status.is_pause_like

    async def _run_code(self, session: SandboxSession, code: str, silent: bool,
                        store_history: bool, out: CellOutput, fields: dict[str, Any]) -> dict[str, Any]:
        kernel = self.kernel
        early = kernel.early_cells.take(kernel.parent_msg_id(), code)
        cell_id = early.cell_id if early else uuid.uuid4().hex
        translate = kernel.events.last_cell = EventTranslator(kernel, session, cell_id)
        try:
            done = await early.result(translate.handle) if early else None
            if done is None:  # (an early cell the sandbox refused was not run)
                done = await session.run_cell(
                    cell_id, code, translate.handle, silent=silent, store_history=store_history,
                    execution_count=kernel.cell_count() if not silent else None,
                    on_resume=lambda: out.progress(f"Sandbox {session.sandbox_id} was paused: resuming…"),
                    fields=fields)
        except RunnerDied as exc:
            await kernel.shutdown.die_with_the_runner(str(exc))
        except SessionError as exc:
            return self.fail("SandboxError", str(exc))
        except SandboxAPIError as exc:
            return self.fail("SandboxError", exc.user_message())
        except Exception as exc:  # a bug of ours must not cost the cell its reply
            log.exception("cell %s failed in the kernel", cell_id)
            return self.fail("SandboxError", f"internal error ({type(exc).__name__}: {exc}); "
                             "details are in the kernel's log")
        finally:
            translate.flush_input_tasks()
        if done.get("status") == "ok":
            payload = kernel.output_filter.page_payload(payload_of(done))
            if translate.asked_exit:  # exit() in the cell: a frontend such as jupyter console ends its session
                payload.append({"source": "ask_exit", "keepkernel": False})
            return self.ok(payload, kernel.output_filter.user_expressions(user_expressions_of(done)))
        error = translate.last_error or {"ename": "Error", "evalue": "", "traceback": []}
        return {"status": "error", "execution_count": kernel.cell_count(), **error}

    @staticmethod
    async def _best_effort(work: Coroutine[Any, Any, T]) -> T | None:
        """An extra the cell can do without (naming egress refusals): failures are logged."""
        try:
            return await work
        except (SandboxAPIError, SessionError) as exc:
            log.warning("skipped: %s", exc)
            return None

    def ok(self, payload: list[dict[str, Any]] | None = None,
           user_expressions: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"status": "ok", "execution_count": self.kernel.cell_count(),
                "payload": payload or [], "user_expressions": user_expressions or {}}

    def fail(self, ename: str, message: str) -> dict[str, Any]:
        """One clear line in the cell (no traceback: the user did nothing wrong in Python)."""
        self.kernel.send_iopub("stream", {"name": "stderr", "text": f"sandbox-kernel: {message}\n"})
        return {"status": "error", "execution_count": self.kernel.cell_count(),
                "ename": ename, "evalue": message, "traceback": []}


def payload_of(done: dict[str, Any]) -> list[dict[str, Any]]:
    """The runner's payloads (page, set_next_input) for the execute_reply; they come from the
    sandbox, so only their shape is checked: a list of objects naming their source."""
    payload = done.get("payload")
    if not isinstance(payload, list):
        return []
    return [item for item in payload if isinstance(item, dict) and isinstance(item.get("source"), str)]


def user_expressions_of(done: dict[str, Any]) -> dict[str, Any]:
    results = done.get("user_expressions")
    if not isinstance(results, dict):
        return {}
    return {str(key): value for key, value in results.items() if isinstance(value, dict)}
