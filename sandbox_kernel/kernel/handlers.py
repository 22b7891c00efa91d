"""SandboxKernel: an ipykernel wrapper kernel whose cells run in a sandbox.

Jupyter messages in, runner events out: execute/complete/inspect/interrupt/input are
forwarded to the session (session.py), and each event the runner emits becomes the
matching iopub message with the request's parent header. is_complete is answered here
on the host. The sandbox is created as soon as the kernel starts; the first cell waits
for it, showing a progress line only if the wait is long (a cell shows no output the user
did not ask for: where the sandbox runs is in the banner, the log and `%sandbox status`).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import concurrent.futures
import contextvars
import json
import logging
import re
import signal
import sys
import threading
import time
import uuid
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, Never, TypeVar

import zmq
from ipykernel import kernel_protocol_version
from ipykernel.kernelapp import IPKernelApp
from ipykernel.kernelbase import Kernel
from traitlets import Unicode

from sandbox_kernel import __version__
from sandbox_kernel.sandbox import early_start, ownership
from sandbox_kernel.guest import protocol
from sandbox_kernel.kernel.allocator import reuse_large_buffers
from sandbox_kernel.api import SandboxAPIError
from sandbox_kernel.config import ConfigError, Settings
from sandbox_kernel.kernel.event_lines import stream_content
from sandbox_kernel.kernel.history import open_history
from sandbox_kernel.kernel.magics import MagicError, SandboxMagics, Segment, split_cell
from sandbox_kernel.kernel.output import CellOutput, OutputGuard
from sandbox_kernel.kernel.output_safety import OutputFilter
from sandbox_kernel.paths import handoff_path, state_dir, write_private
from sandbox_kernel.sandbox.session import RESTART_HANDOFF_WAIT, RunnerDied, SandboxSession, SessionError
from sandbox_kernel.sandbox.shutdown_policy import farewell
from sandbox_kernel.kernel.usage import LOADING, unknown_usage, usage_reply

log = logging.getLogger("sandbox_kernel.kernel.handlers")

HANDOFF_MAX_AGE = RESTART_HANDOFF_WAIT  # a restart hand-off older than this is stale
# Shutting down while the sandbox still starts: wait this long for it (jupyter_client kills
# a kernel that takes 5 s), then stop waiting and find the sandbox by its name (shutdown_policy.py).
BOOT_SHUTDOWN_WAIT = 2.0
# At shutdown, how long the cells being handled have to send their replies (each is told at
# once that the kernel is going: this only lets the reply leave before the loop stops).
REPLY_SHUTDOWN_WAIT = 2.0
KERNEL_INFO_WAIT = 10.0
USAGE_WAIT = 5.0  # seconds a usage_request waits for the sandbox's answer
# A cell that only leaves (`exit` typed in jupyter console): see _is_paused.
EXIT_CELL = re.compile(r"\s*(exit|quit)(\(\))?\s*")
# Bytes of debug events the sandbox may send between two debug requests of the frontend
# (an honest debugger sends a few small events per step); the rest are dropped.
DEBUG_EVENT_BUDGET = 4 * 1024 * 1024
# The request whose cell is running: an execute_request may come on the control channel too,
# and its cell then runs on the shell's loop (where the sandbox session lives), so its
# outputs must not take the shell's parent from there.
REQUEST_PARENT: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("request_parent")
# The execution count of the cell being handled: the one its execute_input showed (cells of
# subshells run meanwhile and take the next numbers).
CELL_COUNT: contextvars.ContextVar[int] = contextvars.ContextVar("cell_count")
COMM_MESSAGES = ("comm_open", "comm_msg", "comm_close")
# Whether ipykernel dispatches the shell message being handled "concurrently": a comm message
# that came while another shell message was being handled, which it announces with no status.
DISPATCHED_CONCURRENTLY: contextvars.ContextVar[bool] = contextvars.ContextVar("dispatched_concurrently",
                                                                               default=False)
STDIN_POLL = 0.01  # seconds between looks for the frontend's input_reply
# Requests whose output the sandbox can still name (an event's PARENT: a thread or task of
# an earlier cell); older ones are forgotten, and their output is shown as if unnamed.
RECENT_REQUESTS = 256
# Runner events that may answer another request than their cell's (see _EventTranslator.handle).
OUTPUT_EVENTS = ("stream", "display_data", "update_display_data", "clear_output", "execute_result", "error",
                 protocol.COMM)
# A cell that waits longer than this for the sandbox to start shows a progress line.
SLOW_START = 2.0
# Options a kernel argument can set (--SandboxKernel.<name>=...); they win over the
# environment and the config file.
KERNEL_ARGUMENTS = ("sandbox_id", "sandbox_name", "on_shutdown", "egress", "shape", "rootfs", "auto_pause",
                    "warm_pool")

T = TypeVar("T")


class WaitInterrupted(Exception):
    """The user interrupted a wait on the sandbox service (start, pause, fork...)."""


class SandboxKernel(Kernel):
    implementation = "sandbox-kernel"
    implementation_version = __version__
    language = "python"
    base_banner = "Python in a sandbox (sandbox-kernel)"

    # Kernel arguments (kernel.json argv), e.g. --SandboxKernel.sandbox_id=sb-...; they win
    # over the matching environment variables.
    sandbox_id = Unicode("", help="drive this existing sandbox (e.g. a fork) instead of creating one"
                         ).tag(config=True)
    sandbox_name = Unicode("", help="name of the sandbox the kernel creates (unique per provider)"
                           ).tag(config=True)
    on_shutdown = Unicode("", help="destroy, pause or keep the sandbox when the kernel shuts down"
                          ).tag(config=True)
    egress = Unicode("", help="egress allowlist for the sandbox the kernel creates, comma-separated"
                     ).tag(config=True)
    shape = Unicode("", help="shape of the sandbox the kernel creates, e.g. s-2vcpu-4gb").tag(config=True)
    rootfs = Unicode("", help="root filesystem of the sandbox the kernel creates").tag(config=True)
    auto_pause = Unicode("", help="seconds idle before the sandbox pauses itself (60-86400, or off)"
                         ).tag(config=True)
    warm_pool = Unicode("", help="keep this many ready sandboxes for starting kernels (0-32)"
                        ).tag(config=True)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.settings: Settings | None = None
        self.config_error: str | None = None
        try:
            self.settings = Settings.from_env(kernel_args={
                name: getattr(self, name) for name in KERNEL_ARGUMENTS})
        except ConfigError as exc:
            self.config_error = str(exc)
        # Not `self.session`: that name is jupyter_client's Session in ipykernel.
        self.sandbox: SandboxSession | None = None
        self.boot: asyncio.Task[None] | None = None
        self.ready_shown = False  # the opt-in ready line (show_ready), shown once
        # Started attached to a sandbox whose runner is of another version: its one line,
        # which the first cell shows (session.other_version_line).
        self.other_version_line: str | None = None
        self.main_loop: asyncio.AbstractEventLoop | None = None
        self.history = open_history(state_dir() / "history.sqlite")
        # A wait an interrupt may cut short (the sandbox start, a magic's pause or fork):
        # the service carries on; only the cell stops waiting.
        self.interruptible: asyncio.Future[Any] | None = None
        self.wait_interrupted = False
        self.memory_limits: dict[str, int] = {}  # bytes, per sandbox id (its shape's memory)
        for msg_type in COMM_MESSAGES:  # delivered to the comm manager in the sandbox
            self.shell_handlers[msg_type] = self._comm_from_frontend
        # ipykernel dispatches comm messages concurrently while a shell message is handled;
        # they must reach the sandbox in the order they came (a comm_msg after its comm_open).
        # Taken on the shell's loop only (see _comm_from_frontend).
        self.comm_order = asyncio.Lock()
        self.cells_executing = 0  # execute_requests being handled (see _comm_from_frontend)
        # The (sub)shells whose failed cell had its queue aborted before the reply (see _abort_queues).
        self.queues_aborted_early: set[str | None] = set()
        # Client sessions that asked is_complete: terminals (see _frontend_updates_in_place).
        self.terminal_sessions: set[str] = set()
        # The last cell's translator: output the runner sends between cells (a background
        # thread's print) is shown on that cell's parent, as ipykernel does.
        self.last_cell: _EventTranslator | None = None
        # The translators of recent requests, by msg_id: an event the sandbox tags with an
        # earlier request's id (a thread that chose its cell) is shown on that request.
        self.recent_requests: collections.OrderedDict[str, _EventTranslator] = collections.OrderedDict()
        self.debug_event_budget = DEBUG_EVENT_BUDGET
        # Each subshell's execute_requests being handled (see delete_subshell_request);
        # they are handled in the subshells' threads, the deletion in the control thread.
        self.subshell_requests: dict[str, set[concurrent.futures.Future[None]]] = {}
        self.subshell_requests_lock = threading.Lock()
        # The count each execute_input showed, by request, until its do_execute takes it.
        self.announced_counts: dict[str, int] = {}
        # What of the sandbox's output may reach the page (%sandbox trust-output), for this
        # kernel's life: a restart filters again.
        self.output_filter = OutputFilter()
        # Set when a shutdown or restart begins ("shutting down", "restarting"): a cell that
        # comes then is answered at once, with one line, rather than run in a closing sandbox.
        self.stopping: str | None = None
        # execute_requests handled and not answered yet, on any thread (see do_shutdown).
        self.unanswered = 0
        self.unanswered_lock = threading.Lock()
        # Per sandbox, how many connections its egress rules had refused at the end of the last
        # cell; None where the provider does not count them (CreateOS). See _name_refusals.
        self.refusals_seen: dict[str, int | None] = {}
        # Per sandbox, the engine stream's count of refusals when refusals_seen was taken.
        self.refusals_hinted: dict[str, int | None] = {}

    # -- start-up --------------------------------------------------------------------------

    def start(self) -> None:
        super().start()
        self.main_loop = asyncio.get_event_loop()
        # interrupt_mode is "message", but a frontend may still send SIGINT: forward it.
        signal.signal(signal.SIGINT, lambda *_: self.main_loop.call_soon_threadsafe(self._interrupt_soon))
        self.boot = self.main_loop.create_task(self._boot())

    async def _boot(self) -> None:
        if self.settings is None:
            raise SessionError(self.config_error or "invalid configuration")
        self.sandbox = SandboxSession(self.settings)
        self.sandbox.on_background = self._background_event
        handoff = self._take_handoff()
        if handoff:  # a restart: same sandbox, fresh Python, same shutdown policy and sandboxes
            for sandbox_id in handoff.get("owned", []):
                ownership.own(sandbox_id)
            await self.sandbox.start(attach_to=handoff["sandbox_id"], fresh_runner=True)
            self.sandbox.on_shutdown = handoff.get("on_shutdown", "destroy")
        else:
            await self.sandbox.start(attach_to=self.settings.attach_to, fresh_runner=False,
                                     early=early_start.take())
            self.other_version_line = self.sandbox.other_version_line()
        if self.settings.on_shutdown:
            self.sandbox.on_shutdown = self.settings.on_shutdown
        log.info("%s", self._ready_line())

    async def _ensure_session(self, out: CellOutput, silent: bool) -> SandboxSession:
        """Wait for the sandbox (a long wait shows progress); retry a failed start once per cell.
        A start that a shutdown gives up (cancels) under the cell is a SessionError saying so."""
        try:
            return await self._wait_for_session(out, silent)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self.boot is None or not self.boot.cancelled() or (task is not None and task.cancelling()):
                raise  # the cell's own wait was cancelled (an interrupt), not the start
            raise SessionError(self._stopping_line()) from None

    async def _wait_for_session(self, out: CellOutput, silent: bool) -> SandboxSession:
        assert self.boot is not None
        if self._boot_failed():
            self.boot = asyncio.get_running_loop().create_task(self._boot())
        if self.settings is None:
            await self.boot  # a configuration error: its line says it all
        if not self.boot.done():
            await asyncio.wait([self.boot], timeout=SLOW_START)
        if not self.boot.done() and not silent:
            line = out.progress(f"Starting a sandbox on {self._provider()}…")
            try:
                await asyncio.shield(self.boot)
            except Exception:
                line.update(f"Starting a sandbox on {self._provider()}… failed")  # the next line says why
                raise
            line.update(self._ready_line())
            self.ready_shown = True
        await self.boot  # raises the start-up error, if any
        if self.settings and self.settings.show_ready and not self.ready_shown and not silent:
            out.progress(self._ready_line())
            self.ready_shown = True
        if self.other_version_line and not silent:
            out.text(self.other_version_line + "\n", name="stderr")
            self.other_version_line = None
        assert self.sandbox is not None
        return self.sandbox

    def _boot_failed(self) -> bool:
        return self.boot is not None and self.boot.done() and (self.boot.cancelled()
                                                                or self.boot.exception() is not None)

    def _stopping_line(self) -> str:
        return f"the kernel is {self.stopping or 'shutting down'}: the cell did not run"

    def _provider(self) -> str:
        return self.settings.description if self.settings else "an unconfigured provider"

    @property
    def banner(self) -> str:  # type: ignore[override]
        """kernel_info's banner: where cells run, once the sandbox is up."""
        if not self._sandbox_ready():
            return self.base_banner
        return f"{self.base_banner}\n{self._ready_line()}"

    def _ready_line(self) -> str:
        assert self.sandbox is not None
        took = f" in {self.sandbox.boot_seconds:.1f} s" if self.sandbox.boot_seconds else ""
        python = self.sandbox.runner_info.get("python_version", "?")
        why = self.settings.why if self.settings else ""
        return (f"Sandbox {self.sandbox.sandbox_id} ready on {self._provider()}{why}{took} "
                f"(Python {python}) · %sandbox --help")

    def _client_session(self) -> str:
        return self.get_parent().get("header", {}).get("session", "")

    def _frontend_updates_in_place(self) -> bool:
        """Notebooks (JupyterLab, VS Code, nbclient) update a display in place; terminal
        frontends (`jupyter console`) ignore update_display_data. A terminal asks whether each
        input is complete before running it, which notebooks never do: that tells them apart."""
        return self._client_session() not in self.terminal_sessions

    def request_parent(self) -> dict[str, Any]:
        """The message the output being sent belongs to (see REQUEST_PARENT)."""
        return REQUEST_PARENT.get(None) or self.get_parent("shell")

    def _send_iopub(self, msg_type: str, content: dict[str, Any]) -> None:
        self.session.send(self.iopub_socket, msg_type, content, self.request_parent())

    # -- execute ---------------------------------------------------------------------------

    async def do_execute(self, code: str, silent: bool, store_history: bool = True,
                         user_expressions: dict | None = None, allow_stdin: bool = False,
                         **_: Any) -> dict[str, Any]:
        """Every execute_request gets its reply, whatever is raised on the way."""
        parent = self.get_parent()  # shell's or control's, by the thread we are on
        request = REQUEST_PARENT.set(parent)
        count = CELL_COUNT.set(self.announced_counts.pop(parent.get("header", {}).get("msg_id"),
                                                         self.execution_count))
        self.cells_executing += 1
        try:
            reply = await self._on_main_loop(
                self._execute(code, silent, store_history, user_expressions or {}, allow_stdin))
        except asyncio.CancelledError:
            raise  # this very request was cancelled: its loop is closing, no reply can leave
        except Exception as exc:  # a bug of ours, or a magic that raised: one line, and the reply
            log.exception("execute_request failed in the kernel")
            reply = self._fail("SandboxError", f"internal error ({type(exc).__name__}: {exc}); "
                               "details are in the kernel's log")
        finally:
            self.cells_executing -= 1
            CELL_COUNT.reset(count)
            REQUEST_PARENT.reset(request)
        if reply["status"] == "error" and not silent and parent["content"].get("stop_on_error", True):
            subshell_id = parent["header"].get("subshell_id")
            super()._abort_queues(subshell_id)
            self.queues_aborted_early.add(subshell_id)
        return reply

    def _abort_queues(self, subshell_id: str | None = None) -> None:
        """After a failed cell, abort the execute_requests queued behind it. ipykernel does it
        once the reply is sent, by queueing a marker from another thread: a frontend's next
        request, sent on that reply, could be queued ahead of the marker and be aborted too
        (under load a cell run right after an interrupted one came back "aborted"). So it is
        done from do_execute, before the reply leaves, and ipykernel's call after it (made in
        exactly the same cases) finds it done."""
        if subshell_id in self.queues_aborted_early:  # a (sub)shell runs one request at a time
            self.queues_aborted_early.discard(subshell_id)
            return
        super()._abort_queues(subshell_id)

    def _publish_execute_input(self, code, parent, execution_count):  # type: ignore[no-untyped-def]
        # Another subshell's request may take the next number before this cell's do_execute starts.
        self.announced_counts[parent["header"]["msg_id"]] = execution_count
        super()._publish_execute_input(code, parent, execution_count)

    def cell_count(self) -> int:
        """The execution count of the cell being handled (see CELL_COUNT)."""
        return CELL_COUNT.get(self.execution_count)

    def subshell_id(self) -> str | None:
        """The subshell of the request being handled (None: the main shell)."""
        subshell_id = self.request_parent().get("header", {}).get("subshell_id")
        return subshell_id if isinstance(subshell_id, str) else None

    async def _execute(self, code: str, silent: bool, store_history: bool,
                       user_expressions: dict[str, Any], allow_stdin: bool) -> dict[str, Any]:
        if not code.strip() and not user_expressions:
            return self._ok()
        if self.stopping:
            return self._fail("KernelStopping", self._stopping_line())
        if store_history and not silent and self.history:
            # At the loop's next turn, which comes once the cell's request is written (SQLite's
            # insert took ~0.2 ms of the way to the sandbox).
            asyncio.get_running_loop().call_soon(self.history.record, self.cell_count(), code)
        out = CellOutput(self._send_iopub, in_place=self._frontend_updates_in_place())
        # Once the sandbox is up there is nothing to wait for, so no interruptible task: its
        # loop turn came before the cell's request, with whatever else was ready to run.
        up = self._sandbox_ready()
        ensure = self._ensure_session(out, silent)
        try:
            session = await (ensure if up else self._interruptible(ensure))
        except SessionError as exc:
            return self._fail("KernelStopping" if self.stopping else "SandboxUnavailable", str(exc))
        except WaitInterrupted:
            return self._fail("KeyboardInterrupt", "interrupted: the sandbox is still starting; "
                              "run a cell when you want it")
        if EXIT_CELL.fullmatch(code) and await self._best_effort(self._is_paused(session)):
            return self._ok([{"source": "ask_exit", "keepkernel": False}])
        magics = SandboxMagics(session, out, self.output_filter)
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
                try:
                    await self._interruptible(magics.run(segment.text))
                except (MagicError, SessionError) as exc:
                    return self._fail("MagicError", str(exc))
                except SandboxAPIError as exc:
                    return self._fail("SandboxError", exc.user_message())
                except WaitInterrupted:
                    return self._fail("KeyboardInterrupt", "interrupted: stopped waiting, but the sandbox "
                                      "service carries on; `%sandbox status` and `%sandbox list` show "
                                      "where it got to")
                continue
            # A silent execution (a frontend's own) shows nothing: its refusals go with the next cell.
            sandbox_id = None if silent else session.sandbox_id
            if sandbox_id is not None and sandbox_id not in self.refusals_seen:
                await self._best_effort(self._count_refusals(session, sandbox_id))
            fields: dict[str, Any] = {"allow_stdin": allow_stdin, "parent_msg_id": self._parent_msg_id()}
            if self.subshell_id() is not None:
                fields[protocol.SUBSHELL_ID] = self.subshell_id()
            if index == last_code and user_expressions:
                fields["user_expressions"] = user_expressions
            reply = await self._run_code(session, segment.text, silent or not segment.text,
                                         store_history and bool(segment.text), out, fields)
            if sandbox_id is not None and self._refusals_may_have_changed(session, sandbox_id):
                await self._best_effort(self._name_refusals(session, sandbox_id, magics))
            if reply["status"] != "ok":
                return reply
            payload += reply["payload"]
            expressions = reply["user_expressions"]
        return self._ok(payload, expressions)

    @staticmethod
    async def _is_paused(session: SandboxSession) -> bool:
        """Whether `exit` can end the frontend's session without running: waking a paused
        sandbox (or one on its way, SandboxStatus.is_pause_like: seconds, and its running price)
        only to leave it helps nobody. One request, for such cells only."""
        return (await session.view()).status.is_pause_like

    async def _count_refusals(self, session: SandboxSession, sandbox_id: str) -> None:
        """The count a sandbox's first cell starts from (an attached one has refusals already)."""
        self.refusals_hinted[sandbox_id] = session.egress_refusals_hint()
        self.refusals_seen[sandbox_id] = (await session.get_egress()).denied_count

    def _refusals_may_have_changed(self, session: SandboxSession, sandbox_id: str) -> bool:
        """Whether to ask the engine for refusals after a cell. Never where the provider does
        not count them (CreateOS: its first answer said so). The local engine's stream tells
        the count ahead of a cell's output (local/processes.py), so a cell without refusals
        costs no request; without that word (no channel), one GET a cell (~1.3 ms locally,
        a round trip to a remote engine)."""
        if self.refusals_seen.get(sandbox_id) is None:
            return False
        hint = session.egress_refusals_hint()
        return hint is None or hint != self.refusals_hinted.get(sandbox_id)

    async def _name_refusals(self, session: SandboxSession, sandbox_id: str, magics: SandboxMagics) -> None:
        """After a cell's code: name the connections the egress rules refused meanwhile, whatever
        the client (its own message is at best '403 Forbidden')."""
        hint = session.egress_refusals_hint()
        view = await session.get_egress()
        before, self.refusals_seen[sandbox_id] = self.refusals_seen[sandbox_id], view.denied_count
        self.refusals_hinted[sandbox_id] = hint
        if before is not None and view.denied_count is not None:
            magics.show_refusals(view, before)

    async def _run_code(self, session: SandboxSession, code: str, silent: bool,
                        store_history: bool, out: CellOutput, fields: dict[str, Any]) -> dict[str, Any]:
        cell_id = uuid.uuid4().hex
        translate = self.last_cell = _EventTranslator(self, session, cell_id)
        try:
            done = await session.run_cell(
                cell_id, code, translate.handle, silent=silent, store_history=store_history,
                execution_count=self.cell_count() if not silent else None,
                on_resume=lambda: out.progress(f"Sandbox {session.sandbox_id} was paused: resuming…"),
                fields=fields)
        except RunnerDied as exc:
            await self._die_with_the_runner(str(exc))
        except SessionError as exc:
            return self._fail("SandboxError", str(exc))
        except SandboxAPIError as exc:
            return self._fail("SandboxError", exc.user_message())
        except Exception as exc:  # a bug of ours must not cost the cell its reply
            log.exception("cell %s failed in the kernel", cell_id)
            return self._fail("SandboxError", f"internal error ({type(exc).__name__}: {exc}); "
                              "details are in the kernel's log")
        finally:
            translate.flush_input_tasks()
        if done.get("status") == "ok":
            payload = self.output_filter.page_payload(_payload_of(done))
            if translate.asked_exit:  # exit() in the cell: a frontend such as jupyter console ends its session
                payload.append({"source": "ask_exit", "keepkernel": False})
            return self._ok(payload, self.output_filter.user_expressions(_user_expressions_of(done)))
        error = translate.last_error or {"ename": "Error", "evalue": "", "traceback": []}
        return {"status": "error", "execution_count": self.cell_count(), **error}

    async def _die_with_the_runner(self, why: str) -> Never:
        """The notebook's Python died: end this kernel process as a kernel whose Python dies
        ends, so that every frontend knows the state is gone (JupyterLab restarts the kernel,
        nbclient raises DeadKernelError). The cell says why; it gets no reply, as under
        ipykernel. The sandbox is handed to the restarted kernel (the restart hand-off), which
        starts a fresh Python in it: the files are kept; with no restart it is left to `gc`."""
        log.warning("%s", why)
        self._send_iopub("stream", {"name": "stderr", "text": f"sandbox-kernel: {why}\n"})
        self.stopping = "restarting"
        assert self.sandbox is not None
        owned = await self.sandbox.close_for_restart()
        if self.sandbox.sandbox_id:
            self._write_handoff(self.sandbox.sandbox_id, self.sandbox.on_shutdown, owned)
        # As ipykernel's shutdown_request ends the process: its loops stop, then atexit sends
        # what IOPub still holds (the line above).
        for stream in (self.control_stream, self.shell_stream):
            if stream is not None:
                stream.io_loop.add_callback(stream.io_loop.stop)
        self.io_loop.add_callback(self.io_loop.stop)
        await asyncio.Event().wait()  # this cell ends with the process
        raise AssertionError("unreachable")

    async def _background_event(self, event: dict[str, Any]) -> None:
        """Runner output between cells: on the last cell's parent, within its output cap."""
        if event.get("type") == protocol.DEBUG_EVENT:
            self._publish_sandbox_debug_event(event.get("content"))
        elif self.last_cell is not None and event.get("type") != "input_request":
            await self.last_cell.handle(event)

    @staticmethod
    async def _best_effort(work: Coroutine[Any, Any, T]) -> T | None:
        """An extra the cell can do without (naming egress refusals): failures are logged."""
        try:
            return await work
        except (SandboxAPIError, SessionError) as exc:
            log.warning("skipped: %s", exc)
            return None

    def _ok(self, payload: list[dict[str, Any]] | None = None,
            user_expressions: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"status": "ok", "execution_count": self.cell_count(),
                "payload": payload or [], "user_expressions": user_expressions or {}}

    def _fail(self, ename: str, message: str) -> dict[str, Any]:
        """One clear line in the cell (no traceback: the user did nothing wrong in Python)."""
        self._send_iopub("stream", {"name": "stderr", "text": f"sandbox-kernel: {message}\n"})
        return {"status": "error", "execution_count": self.cell_count(),
                "ename": ename, "evalue": message, "traceback": []}

    # -- interrupt, input, completion ------------------------------------------------------

    async def interrupt_request(self, stream, ident, parent):  # type: ignore[no-untyped-def]
        content: dict[str, Any] = {"status": "ok"}
        try:
            await self._on_main_loop(self._interrupt())
        except Exception as exc:  # the reply must go out whatever happened
            content = {"status": "error", "ename": type(exc).__name__, "evalue": str(exc),
                       "traceback": []}
        self.session.send(stream, "interrupt_reply", content, parent, ident=ident)

    async def ask_frontend(self, prompt: str, password: bool) -> str | None:
        """An input_request on the stdin channel; the answer, or None if the frontend cannot
        give one (no stdin, EOF). Awaited on the shell's loop, never in a thread: a question
        the user interrupted is cancelled here, so no thread is left on the stdin socket
        (zmq sockets are not thread-safe, and such a thread would hold up shutdown)."""
        if not self.request_parent().get("content", {}).get("allow_stdin", False):
            return None
        socket = self.stdin_socket
        while self.session.recv(socket, mode=zmq.NOBLOCK)[1] is not None:
            pass  # the answer to an earlier question, interrupted
        ident = self._get_shell_context_var(self._shell_parent_ident)
        self.session.send(socket, "input_request", {"prompt": prompt, "password": password},
                          self.get_parent("shell"), ident=ident)
        while True:
            try:
                _, reply = self.session.recv(socket, mode=zmq.NOBLOCK)
            except Exception as exc:  # a malformed message: wait for a good one
                log.warning("invalid input_reply: %s", exc)
                reply = None
            if reply is not None:
                value = reply.get("content", {}).get("value", "")
                return None if value == "\x04" else str(value)  # ^D: end of input
            await asyncio.sleep(STDIN_POLL)

    async def _interruptible(self, work: Coroutine[Any, Any, T]) -> T:
        """Await work; an interrupt meanwhile raises WaitInterrupted (work is cancelled).
        Not in a subshell: an interrupt is the main shell's (as under ipykernel)."""
        if self.subshell_id() is not None:
            return await work
        self.interruptible = task = asyncio.ensure_future(work)
        self.wait_interrupted = False
        try:
            return await task
        except asyncio.CancelledError:
            if self.wait_interrupted and task.cancelled():
                raise WaitInterrupted() from None
            raise  # the kernel itself is being cancelled (shutdown)
        finally:
            self.interruptible = None

    async def _interrupt(self) -> None:
        if self.interruptible is not None and not self.interruptible.done():
            self.wait_interrupted = True
            self.interruptible.cancel()
            return
        if self.boot and not self.boot.done():
            return  # no cell is waiting for the sandbox that is starting
        if self.sandbox and self.sandbox.sandbox_id:
            await self.sandbox.interrupt()

    def _interrupt_soon(self) -> None:
        asyncio.get_running_loop().create_task(self._interrupt())

    async def _on_main_loop(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run coro on the shell's event loop, where the sandbox session, its channel and
        their futures and locks live: control messages and subshells' messages are handled
        on threads of their own, each with its own loop."""
        assert self.main_loop is not None
        if asyncio.get_running_loop() is self.main_loop:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.main_loop))

    async def do_complete(self, code: str, cursor_pos: int) -> dict[str, Any]:
        reply = await self._runner_query({protocol.OP: protocol.COMPLETE, "code": code, "cursor_pos": cursor_pos})
        return {"status": "ok", "matches": reply.get("matches", []),
                "cursor_start": reply.get("cursor_start", cursor_pos),
                "cursor_end": reply.get("cursor_end", cursor_pos),
                "metadata": reply.get("metadata", {})}

    async def do_inspect(self, code: str, cursor_pos: int, detail_level: int = 0,
                         omit_sections: Any = ()) -> dict[str, Any]:
        reply = await self._runner_query({protocol.OP: protocol.INSPECT, "code": code, "cursor_pos": cursor_pos,
                                          "detail_level": detail_level})
        data, metadata = self.output_filter.bundle(reply.get("data", {}), reply.get("metadata", {}))
        return {"status": "ok", "found": reply.get("found", False), "data": data, "metadata": metadata}

    def _sandbox_ready(self) -> bool:
        return not (self.boot is None or not self.boot.done() or self._boot_failed() or self.sandbox is None)

    async def _runner_query(self, message: dict[str, Any]) -> dict[str, Any]:
        """Completion and inspection are best effort: an empty answer beats an error popup."""
        if not self._sandbox_ready():
            return {}
        try:
            return await self._on_main_loop(self.sandbox.runner_request(message))
        except Exception as exc:
            log.warning("%s failed: %s", message[protocol.OP], exc)
            return {}

    async def usage_request(self, stream, ident, parent):  # type: ignore[no-untyped-def]
        """JupyterLab's kernel usage panel: the sandbox's CPU and memory (not this process's),
        in the fields of ipykernel's usage_reply; without a sample, the same fields (null) and
        the reason (usage.unknown_usage)."""
        try:
            content = await self._on_main_loop(asyncio.wait_for(self._sandbox_usage(), USAGE_WAIT))
        except asyncio.TimeoutError:
            content = unknown_usage("timeout", timeout_ms=int(USAGE_WAIT * 1000))  # the panel's word for it
        except Exception as exc:
            log.warning("usage: %s", exc)
            content = unknown_usage("the sandbox did not answer")
        self.session.send(stream, "usage_reply", content, parent, ident=ident)

    async def _sandbox_usage(self) -> dict[str, Any]:
        if not self._sandbox_ready():
            return unknown_usage("no sandbox: it did not start" if self._boot_failed() else LOADING)
        assert self.sandbox is not None
        sample = await self.sandbox.runner_request({protocol.OP: protocol.USAGE})
        sandbox_id = self.sandbox.sandbox_id or ""
        if sandbox_id not in self.memory_limits:
            self.memory_limits[sandbox_id] = ((await self.sandbox.view()).mem_mib or 0) * 2**20
        return usage_reply(sample, self.memory_limits[sandbox_id])

    # -- comms (ipywidgets...): the comm manager lives in the sandbox ---------------------------

    async def dispatch_shell(self, msg, /, subshell_id=None, *, concurrent=False):  # type: ignore[no-untyped-def]
        """Each message is handled in a context of its own. ipykernel runs all of a shell's
        messages in one shared context, and when a comm message it dispatched concurrently
        ends, it sets that context's parent back to the one it saw when it began. Here comm
        handlers take a round trip, so a message handled in turn may have begun meanwhile:
        it then published its idle under the restored (earlier) parent, and the frontend
        never saw this message go idle (ipywidgets' page stopped sending changes)."""
        context = contextvars.copy_context()
        context.run(DISPATCHED_CONCURRENTLY.set, concurrent)
        await asyncio.create_task(super().dispatch_shell(msg, subshell_id=subshell_id, concurrent=concurrent),
                                  context=context)

    async def _comm_from_frontend(self, stream, ident, parent):  # type: ignore[no-untyped-def]
        """comm_open/comm_msg/comm_close: run in the sandbox like a silent cell, so the
        handlers' messages (a widget's echo, its output) come back with this one as parent.

        ipykernel hands over a comm message that comes while another shell message is handled
        at once, without the busy and idle statuses of its parent; here handlers take a round
        trip to the sandbox, so in a burst of widget changes most messages come that way. But
        ipywidgets' frontend sends a widget's next change only once the previous message is
        idle: without the statuses the last changes of a burst were never sent. So each gets
        them, in turn, as ipykernel's own comm messages do, unless a cell is running (the
        kernel is busy with it: a cell may await a widget's answer).

        JupyterLab sends a comm target's messages on a subshell of their own once the kernel
        has subshells (and on the main shell until it is made), so they may be handled on a
        subshell's thread: they are delivered from the shell's loop, in one order with the
        main shell's. From the subshell's loop, the channel's answer (a future the shell's
        loop completes) did not wake it, and the message hung until another came; and the
        order lock, taken from two loops, refused one ("bound to a different event loop")."""
        announce = DISPATCHED_CONCURRENTLY.get() and not self.cells_executing
        # Its own parent: one that comes during a cell is handled in the cell's context (the
        # shell's loop runs the delivery in a copy of this context, with this parent).
        request = REQUEST_PARENT.set(parent)
        try:
            await self._on_main_loop(self._deliver_comm(parent, announce))
        finally:
            REQUEST_PARENT.reset(request)

    async def _deliver_comm(self, parent: dict[str, Any], announce: bool) -> None:
        if not self._sandbox_ready():
            log.warning("%s before the sandbox is up: dropped", parent["header"]["msg_type"])
            return
        assert self.sandbox is not None
        self.output_filter.comm_from_frontend(parent["header"]["msg_type"], parent["content"])
        message = {"msg_type": parent["header"]["msg_type"], "content": parent["content"],
                   "metadata": parent.get("metadata") or {},
                   "buffers": [base64.b64encode(bytes(buffer)).decode("ascii") for buffer in parent.get("buffers") or []]}
        cell_id = uuid.uuid4().hex
        translate = _EventTranslator(self, self.sandbox, cell_id)
        try:
            async with self.comm_order:
                if announce:
                    self._publish_status("busy", "shell", parent)
                try:
                    await self.sandbox.run_cell(cell_id, "", translate.handle, silent=True, store_history=False,
                                                fields={"comm": message, "parent_msg_id": self._parent_msg_id()})
                finally:
                    if announce:
                        self._publish_status("idle", "shell", parent)
        except Exception as exc:  # no reply to send: the frontend learns nothing, the log does
            log.warning("%s not delivered: %s", message["msg_type"], exc)
        finally:
            translate.flush_input_tasks()

    def _parent_msg_id(self) -> str:
        """The id of the request being handled: its output in the sandbox goes out with this
        parent, and ipywidgets' Output widget there captures output by it."""
        return str(self.request_parent().get("header", {}).get("msg_id", ""))

    async def comm_info_request(self, stream, ident, parent):  # type: ignore[no-untyped-def]
        target_name = parent["content"].get("target_name")
        answer = await self._runner_query({protocol.OP: protocol.COMM_INFO, "target_name": target_name})
        comms = answer.get("comms") if isinstance(answer.get("comms"), dict) else {}
        comms = {str(comm_id): {"target_name": str(info.get("target_name", ""))}
                 for comm_id, info in comms.items() if isinstance(info, dict)}
        self.session.send(stream, "comm_info_reply", {"status": "ok", "comms": comms}, parent, ident=ident)

    async def do_is_complete(self, code: str) -> dict[str, Any]:
        self.terminal_sessions.add(self._client_session())
        from IPython.core.inputtransformer2 import TransformerManager

        status, indent = TransformerManager().check_complete(code)
        reply: dict[str, Any] = {"status": status}
        if status == "incomplete":
            reply["indent"] = " " * (indent or 0)
        return reply

    async def do_history(self, hist_access_type: str, output: bool, raw: bool,
                         **request: Any) -> dict[str, Any]:
        entries = self.history.reply(hist_access_type, output, **request) if self.history else []
        return {"status": "ok", "history": entries}

    # -- kernel info -----------------------------------------------------------------------

    async def kernel_info_request(self, stream, ident, parent):  # type: ignore[no-untyped-def]
        await self._wait_for_boot()  # to report the sandbox's Python and what it can do
        await super().kernel_info_request(stream, ident, parent)

    async def _wait_for_boot(self) -> None:
        """Wait (at most KERNEL_INFO_WAIT) for the sandbox to be up, if it is starting."""
        if self.boot is not None and not self.boot.done():
            boot = self.boot
            await self._on_main_loop(asyncio.wait([boot], timeout=KERNEL_INFO_WAIT))

    @property
    def kernel_info(self) -> dict[str, Any]:  # type: ignore[override]
        # Not ipykernel's: to list "debugger" and "kernel subshells" (its own machinery) it
        # imports its debugger and debugpy into this process, 65 ms or more on the first
        # kernel_info, which a starting notebook waits for. Only what reaches into the
        # sandbox is advertised, where the sandbox has it.
        debugger = self._debugger_available()
        features = (["kernel subshells"] if self._subshells_available() else []) + (["debugger"] if debugger else [])
        return {"protocol_version": kernel_protocol_version, "implementation": self.implementation,
                "implementation_version": self.implementation_version, "language_info": self.language_info,
                "banner": self.banner, "help_links": self.help_links,
                "supported_features": features, "debugger": debugger}

    # -- debugger: debugpy in the sandbox (runner_debug.py) --------------------------------

    def _debugger_available(self) -> bool:
        """The sandbox's Python has debugpy and IPython, and a channel carries its events
        (the exec-per-cell fallback has none)."""
        return self._runner_offers("debugger")

    def _runner_offers(self, feature: str) -> bool:
        """The sandbox is up, a channel reaches its runner, and the runner says it has `feature`."""
        return (self._sandbox_ready() and self.sandbox is not None and self.sandbox.channel is not None
                and self.sandbox.runner_info.get(feature) is True)

    async def do_debug_request(self, msg: dict[str, Any]) -> dict[str, Any]:
        """A DAP request, answered by the debugger in the sandbox; unsuccessful where there is none."""
        await self._wait_for_boot()
        if not self._debugger_available():
            return _debug_refusal(msg, "sandbox-kernel has no debugger for this sandbox: its Python needs "
                                  "IPython and debugpy (`%pip install debugpy`, then restart the kernel)")
        assert self.sandbox is not None
        self.debug_event_budget = DEBUG_EVENT_BUDGET  # the frontend is listening
        try:
            answer = await self._on_main_loop(
                self.sandbox.runner_request({protocol.OP: protocol.DEBUG, "request": msg}))
        except Exception as exc:  # a runner that died or stopped answering: the reply says so
            return _debug_refusal(msg, f"the debugger in the sandbox did not answer: {exc}")
        response = answer.get("response")
        if not isinstance(response, dict):
            return _debug_refusal(msg, "the debugger in the sandbox gave no response")
        return self.output_filter.debug_response(response)

    def _publish_sandbox_debug_event(self, content: object) -> None:
        """A DAP event of the sandbox's debugger, on IOPub, within DEBUG_EVENT_BUDGET."""
        if not isinstance(content, dict) or content.get("type") != "event":
            return
        size = len(json.dumps(content))
        if size > self.debug_event_budget:
            log.warning("dropped a debug event of %d bytes: over the budget between debug requests", size)
            return
        self.debug_event_budget -= size
        self.session.send(self.iopub_socket, "debug_event", content, self.get_parent("control"))

    # -- kernel subshells: ipykernel's threads here, and one thread each in the runner ------

    def _subshells_available(self) -> bool:
        """The runner can run a subshell's cells in a thread of its own (it has IPython), and a
        channel carries several cells at once (the exec-per-cell fallback does not)."""
        return self._supports_kernel_subshells and self._runner_offers("subshells")

    async def _subshells_ready(self) -> bool:
        await self._wait_for_boot()
        return self._subshells_available()

    def _subshell_manager_call(self, request: dict[str, Any]) -> dict[str, Any]:
        """A request to ipykernel's subshell manager, which runs in the shell channel thread
        (what ipykernel's own handlers send it), and its answer (at once: it only starts or
        stops a thread)."""
        manager_socket = self.shell_channel_thread.manager.control_to_shell_channel.from_socket
        manager_socket.send_json(request)
        return manager_socket.recv_json()  # type: ignore[no-any-return]

    async def _runner_subshell(self, action: str, subshell_id: str) -> None:
        assert self.sandbox is not None
        await self._on_main_loop(self.sandbox.runner_request(
            {protocol.OP: protocol.SUBSHELL, "action": action, protocol.SUBSHELL_ID: subshell_id}))

    async def create_subshell_request(self, socket, ident, parent):  # type: ignore[no-untyped-def]
        """ipykernel's subshell (a thread here that handles its shell messages), and its
        thread in the runner, made before the reply (a cell may count the threads next)."""
        if not await self._subshells_ready():
            return self._no_subshells(socket, "create_subshell_reply", parent, ident)
        reply = self._subshell_manager_call({"type": "create"})
        if reply.get("status") == "ok":
            try:
                await self._runner_subshell("create", reply["subshell_id"])
            except Exception as exc:  # the runner died or refused: no subshell then
                self._subshell_manager_call({"type": "delete", "subshell_id": reply["subshell_id"]})
                reply = {"status": "error", "evalue": f"the sandbox could not start a subshell: {exc}"}
        self.session.send(socket, "create_subshell_reply", reply, parent, ident=ident)

    async def delete_subshell_request(self, socket, ident, parent):  # type: ignore[no-untyped-def]
        """As ipykernel's delete, which joins the subshell's thread: a cell it is running
        finishes first (and is answered), then the subshell ends, here and in the runner."""
        if not await self._subshells_ready():
            return self._no_subshells(socket, "delete_subshell_reply", parent, ident)
        subshell_id = parent["content"].get("subshell_id")
        with self.subshell_requests_lock:
            running = list(self.subshell_requests.get(subshell_id, ()))
        if running:
            await asyncio.wait([asyncio.wrap_future(request) for request in running])
        reply = self._subshell_manager_call({"type": "delete", "subshell_id": subshell_id})
        if reply.get("status") == "ok":
            try:
                await self._runner_subshell("delete", subshell_id)
            except Exception as exc:  # a runner that died took its threads along
                log.warning("subshell %s: %s", subshell_id, exc)
        self.session.send(socket, "delete_subshell_reply", reply, parent, ident=ident)

    async def list_subshell_request(self, socket, ident, parent):  # type: ignore[no-untyped-def]
        if not await self._subshells_ready():
            return self._no_subshells(socket, "list_subshell_reply", parent, ident)
        reply = self._subshell_manager_call({"type": "list"})
        self.session.send(socket, "list_subshell_reply", reply, parent, ident=ident)

    def _no_subshells(self, socket: Any, reply_type: str, parent: dict[str, Any], ident: Any) -> None:
        """No subshells here (yet): refused, not left unanswered."""
        why = ("the sandbox is not up: a cell shows why" if not self._sandbox_ready() else
               "they need IPython in the sandbox and a provider with managed processes")
        self.session.send(socket, reply_type, {
            "status": "error", "ename": "NotImplementedError", "traceback": [],
            "evalue": f"sandbox-kernel has no kernel subshells now: {why}"}, parent, ident=ident)

    async def execute_request(self, stream, ident, parent):  # type: ignore[no-untyped-def]
        """ipykernel's, counted until answered (see do_shutdown)."""
        with self.unanswered_lock:
            self.unanswered += 1
        try:
            return await self._execute_request(stream, ident, parent)
        finally:
            with self.unanswered_lock:
                self.unanswered -= 1

    async def _execute_request(self, stream, ident, parent):  # type: ignore[no-untyped-def]
        """A subshell's request is tracked until answered (see delete_subshell_request)."""
        subshell_id = parent["header"].get("subshell_id")
        if not isinstance(subshell_id, str):
            return await super().execute_request(stream, ident, parent)
        answered: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self.subshell_requests_lock:
            self.subshell_requests.setdefault(subshell_id, set()).add(answered)
        try:
            return await super().execute_request(stream, ident, parent)
        finally:
            answered.set_result(None)
            with self.subshell_requests_lock:
                requests = self.subshell_requests.get(subshell_id, set())
                requests.discard(answered)
                if not requests:
                    self.subshell_requests.pop(subshell_id, None)

    @property
    def language_info(self) -> dict[str, Any]:  # type: ignore[override]
        version = ""
        if self.sandbox is not None:
            version = self.sandbox.runner_info.get("python_version", "")
        return {"name": "python", "version": version, "mimetype": "text/x-python",
                "file_extension": ".py", "pygments_lexer": "ipython3",
                "codemirror_mode": {"name": "ipython", "version": 3},
                "nbconvert_exporter": "python"}

    # -- shutdown and restart --------------------------------------------------------------

    async def do_shutdown(self, restart: bool) -> dict[str, Any]:
        self.stopping = "restarting" if restart else "shutting down"
        if self.sandbox is not None:
            try:
                # The request arrives on the control thread; the API client lives on the shell's loop.
                if restart:
                    # jupyter_client restarts by starting a new kernel process: hand it our
                    # sandboxes, so a restart is a fresh runner in the same sandbox.
                    owned = await self._on_main_loop(self.sandbox.close_for_restart())
                    if self.sandbox.sandbox_id:
                        self._write_handoff(self.sandbox.sandbox_id, self.sandbox.on_shutdown, owned)
                else:
                    await self._on_main_loop(self._stop_boot())
                    self._last_words(farewell(await self._on_main_loop(self.sandbox.shutdown())))
            except Exception as exc:
                log.warning("shutdown: %s", exc)
        await self._replies_sent()
        return {"status": "ok", "restart": restart}

    async def _replies_sent(self) -> None:
        """Every execute_request gets its reply: the cells being handled (told that the kernel
        is going, or ended with their sandbox's channel) are given a moment to send theirs
        before ipykernel stops the loops."""
        deadline = time.monotonic() + REPLY_SHUTDOWN_WAIT
        while self.unanswered and time.monotonic() < deadline:
            await asyncio.sleep(STDIN_POLL)

    async def _stop_boot(self) -> None:
        if self.boot is not None and not self.boot.done():
            await asyncio.wait([self.boot], timeout=BOOT_SHUTDOWN_WAIT)
            self.boot.cancel()

    def _last_words(self, text: str) -> None:
        """What outlives the notebook, on the frontend (if it still listens) and in the log."""
        if text:
            log.warning("%s", text.strip())
            self.send_response(self.iopub_socket, "stream", {"name": "stderr", "text": text}, channel="control")

    def _handoff_path(self) -> Path | None:
        connection_file = getattr(self.parent, "connection_file", None)
        return handoff_path(connection_file) if connection_file else None

    def _write_handoff(self, sandbox_id: str, on_shutdown: str, owned: list[str]) -> None:
        path = self._handoff_path()
        if path is not None:
            path.parent.mkdir(mode=0o700, exist_ok=True)
            write_private(path, json.dumps({"sandbox_id": sandbox_id, "on_shutdown": on_shutdown,
                                            "owned": owned, "time": time.time()}))

    def _take_handoff(self) -> dict[str, Any] | None:
        path = self._handoff_path()
        if path is None or not path.exists():
            return None
        try:
            info = json.loads(path.read_text())
        finally:
            path.unlink(missing_ok=True)
        if time.time() - info.get("time", 0) > HANDOFF_MAX_AGE or "sandbox_id" not in info:
            return None
        return info


def _debug_refusal(request: dict[str, Any], message: str) -> dict[str, Any]:
    return {"type": "response", "seq": 0, "request_seq": request.get("seq", 0), "success": False,
            "command": request.get("command", ""), "message": message}


def _payload_of(done: dict[str, Any]) -> list[dict[str, Any]]:
    """The runner's payloads (page, set_next_input) for the execute_reply; they come from the
    sandbox, so only their shape is checked: a list of objects naming their source."""
    payload = done.get("payload")
    if not isinstance(payload, list):
        return []
    return [item for item in payload if isinstance(item, dict) and isinstance(item.get("source"), str)]


def _user_expressions_of(done: dict[str, Any]) -> dict[str, Any]:
    results = done.get("user_expressions")
    if not isinstance(results, dict):
        return {}
    return {str(key): value for key, value in results.items() if isinstance(value, dict)}


class _EventTranslator:
    """Turns one cell's runner events into iopub messages (and stdin requests)."""

    def __init__(self, kernel: SandboxKernel, session: SandboxSession, cell_id: str) -> None:
        self.kernel = kernel
        self.session = session
        self.cell_id = cell_id
        self.last_error: dict[str, Any] | None = None
        self.asked_exit = False
        self.input_task: asyncio.Task[None] | None = None  # the question the frontend was asked
        self.dropped_input_request = False
        self.guard = OutputGuard(session.settings.output_limit)
        # Its cell's request: events that come after the cell (from a background thread)
        # still belong to it. The events are handled in the channel's reader task, whose
        # context is not the cell's: stdin requests are made in the cell's (ipykernel
        # keeps the parent and its ident in context variables).
        self.parent = kernel.request_parent()
        self.execution_count = kernel.cell_count()
        self.context = contextvars.copy_context()
        msg_id = self.parent.get("header", {}).get("msg_id")
        if msg_id:
            kernel.recent_requests[msg_id] = self
            kernel.recent_requests.move_to_end(msg_id)
            while len(kernel.recent_requests) > RECENT_REQUESTS:
                kernel.recent_requests.popitem(last=False)

    def _send(self, _: Any, msg_type: str, content: dict[str, Any]) -> None:
        self.kernel.session.send(self.kernel.iopub_socket, msg_type, content, self.parent)

    async def handle(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        named = event.get(protocol.PARENT)
        if kind in OUTPUT_EVENTS and isinstance(named, str):
            owner = self.kernel.recent_requests.get(named)  # the sandbox's word: only ids we sent count
            if owner is not None and owner is not self:
                await owner.handle(event)
                return
        send = self._send
        iopub = self.kernel.iopub_socket
        if not self.guard.admit(event):
            notice = self.guard.notice()
            if notice:
                send(iopub, "stream", {"name": "stderr", "text": notice})
        elif kind == "stream":
            send(iopub, "stream", stream_content(event))
        elif kind in ("display_data", "update_display_data"):
            data, metadata = self.kernel.output_filter.bundle(event["data"], event.get("metadata", {}))
            send(iopub, kind, {"data": data, "metadata": metadata, "transient": event.get("transient", {})})
        elif kind == "clear_output":
            send(iopub, "clear_output", {"wait": event.get("wait", False)})
        elif kind == "execute_result":
            data, metadata = self.kernel.output_filter.bundle(event["data"], event.get("metadata", {}))
            send(iopub, "execute_result", {"execution_count": self.execution_count, "data": data,
                                           "metadata": metadata})
        elif kind == "error":
            self.last_error = {"ename": event["ename"], "evalue": event["evalue"],
                               "traceback": event["traceback"]}
            send(iopub, "error", self.last_error)
        elif kind == protocol.COMM:
            self._forward_comm(event)
        elif kind == "ask_exit":
            self.asked_exit = True
        elif kind == "input_request":
            self._input_request(event)

    def _forward_comm(self, event: dict[str, Any]) -> None:
        """A message of a comm in the sandbox, to the frontend, binary buffers restored."""
        content, buffers = event.get("content"), event.get("buffers") or []
        if event.get("msg_type") not in COMM_MESSAGES or not isinstance(content, dict) or not isinstance(buffers, list):
            return
        try:
            raw = [base64.b64decode(buffer, validate=True) for buffer in buffers]
        except (TypeError, ValueError):
            log.warning("dropped a comm message with malformed buffers")
            return
        metadata = event.get("metadata") if isinstance(event.get("metadata"), dict) else {}
        allowed = self.kernel.output_filter.comm_from_sandbox(event["msg_type"], content, raw)
        if allowed is None:
            return
        content, raw = allowed
        # On its cell's parent, like the cell's other output (this runs in the channel's reader
        # task, whose context holds no parent): the frontend's Output widgets capture by it.
        self.kernel.session.send(self.kernel.iopub_socket, event["msg_type"], content, self.parent,
                                 buffers=raw, metadata=metadata)

    def _input_request(self, event: dict[str, Any]) -> None:
        """Ask the frontend, without blocking the event stream while the user types. One
        question of a cell at a time: the runner asks one and waits for its answer, so a
        second one meanwhile is forged by code in the sandbox, and is dropped (one log line
        a cell), costing no more than this check."""
        if self.input_task is not None and not self.input_task.done():
            if not self.dropped_input_request:
                self.dropped_input_request = True
                log.warning("cell %s: dropped an input_request while one was waiting for its answer", self.cell_id)
            return
        prompt, password = event.get("prompt", ""), event.get("password", False)
        self.input_task = self.context.run(
            asyncio.get_running_loop().create_task,
            self._ask(prompt if isinstance(prompt, str) else "", password if isinstance(password, bool) else False))

    async def _ask(self, prompt: str, password: bool) -> None:
        await self.session.send_input(self.cell_id, await self.kernel.ask_frontend(prompt, password))

    def flush_input_tasks(self) -> None:
        if self.input_task is not None:
            self.input_task.cancel()


def main() -> None:
    """ipykernel's own app (its log lines keep their "[IPKernelApp]" prefix, which tools such
    as nbclient expect)."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    reuse_large_buffers()
    # No OutStream for the kernel process: the notebook's output comes from the sandbox, and
    # what this process writes (a library's warning) belongs in its log, not in a cell. ipykernel
    # flushes sys.stdout and sys.stderr four times a cell, each an OutStream's round trip to the
    # IOPub thread while the shell waits: ~2 ms of a trivial cell's 16 measured side by side.
    # At exit the control thread's flush after its shutdown_reply waited for IOPub, which
    # ipykernel had stopped already, and the kernel lingered 10 s (killed by jupyter_client).
    app = IPKernelApp.instance(kernel_class=SandboxKernel, outstream_class=None)
    app.initialize()
    # traitlets leaves the app's logger at DEBUG and filters in its handlers: every debug line
    # of ipykernel's (several a message, the message formatted whole) was made, then dropped.
    # The logger now lets through only what some handler of it would write.
    app.log.setLevel(min((handler.level or logging.DEBUG for handler in app.log.handlers), default=app.log_level))
    # The kernel's own lines (where its sandbox runs) at the app's level: `--debug` or
    # `--IPKernelApp.log_level=INFO` shows them; by default stderr stays as quiet as ipykernel's.
    logging.getLogger("sandbox_kernel").setLevel(app.log_level)
    app.start()
