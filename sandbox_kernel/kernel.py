"""SandboxKernel: an ipykernel wrapper kernel whose cells run in a sandbox.

Jupyter messages in, runner events out: execute/complete/inspect/interrupt/input are
forwarded to the session (session.py), and each event the runner emits becomes the
matching iopub message with the request's parent header. is_complete is answered here
on the host. The sandbox is created as soon as the kernel starts; the first cell waits
for it, showing a progress line.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import json
import logging
import signal
import sys
import time
import uuid
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from ipykernel.kernelbase import Kernel
from traitlets import Unicode

from . import __version__, ownership, runner_protocol as protocol
from .api import SandboxAPIError
from .config import ConfigError, Settings
from .history import open_history
from .magics import PIP_COMMAND, MagicError, SandboxMagics, split_cell
from .output import CellOutput, OutputGuard
from .shutdown_policy import farewell
from .paths import state_dir, write_private
from .session import RESTART_HANDOFF_WAIT, SandboxSession, SessionError

log = logging.getLogger("sandbox_kernel.kernel")

HANDOFF_MAX_AGE = RESTART_HANDOFF_WAIT  # a restart hand-off older than this is stale
# Shutting down while the sandbox still starts: wait this long for it (jupyter_client kills
# a kernel that takes 5 s), then stop waiting and find the sandbox by its name (shutdown_policy.py).
BOOT_SHUTDOWN_WAIT = 2.0
KERNEL_INFO_WAIT = 10.0
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
    banner = "Python in a sandbox (sandbox-kernel)"

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
        self.status_shown = False
        self.main_loop: asyncio.AbstractEventLoop | None = None
        self.history = open_history(state_dir() / "history.sqlite")
        # A wait an interrupt may cut short (the sandbox start, a magic's pause or fork):
        # the service carries on; only the cell stops waiting.
        self.interruptible: asyncio.Future[Any] | None = None
        self.wait_interrupted = False
        # Client sessions that asked is_complete: terminals (see _frontend_updates_in_place).
        self.terminal_sessions: set[str] = set()
        # The last cell's translator: output the runner sends between cells (a background
        # thread's print) is shown on that cell's parent, as ipykernel does.
        self.last_cell: _EventTranslator | None = None

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
            await self.sandbox.start(attach_to=self.settings.attach_to, fresh_runner=False)
        if self.settings.on_shutdown:
            self.sandbox.on_shutdown = self.settings.on_shutdown

    async def _ensure_session(self, out: CellOutput) -> SandboxSession:
        """Wait for the sandbox, showing progress; retry a failed start once per cell."""
        assert self.boot is not None
        if self.boot.done() and self.boot.exception() is not None:
            self.boot = asyncio.get_running_loop().create_task(self._boot())
        if self.settings is None:
            await self.boot  # a configuration error: its line says it all
        if not self.boot.done():
            line = out.progress(f"Starting a sandbox on {self._provider()}…")
            try:
                await asyncio.shield(self.boot)
            except Exception:
                line.update(f"Starting a sandbox on {self._provider()}… failed")  # the next line says why
                raise
            line.update(self._ready_line())
            self.status_shown = True
        await self.boot  # raises the start-up error, if any
        if not self.status_shown:
            out.progress(self._ready_line())
            self.status_shown = True
        assert self.sandbox is not None
        return self.sandbox

    def _provider(self) -> str:
        return self.settings.description if self.settings else "an unconfigured provider"

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

    def _send_iopub(self, msg_type: str, content: dict[str, Any]) -> None:
        self.send_response(self.iopub_socket, msg_type, content)

    # -- execute ---------------------------------------------------------------------------

    async def do_execute(self, code: str, silent: bool, store_history: bool = True,
                         user_expressions: dict | None = None, allow_stdin: bool = False,
                         **_: Any) -> dict[str, Any]:
        """Every execute_request gets its reply, whatever is raised on the way."""
        try:
            return await self._execute(code, silent, store_history, allow_stdin)
        except asyncio.CancelledError:
            raise  # the kernel is shutting down
        except Exception as exc:  # a bug of ours, or a magic that raised: one line, and the reply
            log.exception("execute_request failed in the kernel")
            return self._fail("SandboxError", f"internal error ({type(exc).__name__}: {exc}); "
                              "details are in the kernel's log")

    async def _execute(self, code: str, silent: bool, store_history: bool, allow_stdin: bool) -> dict[str, Any]:
        if not code.strip():
            return self._ok()
        if store_history and not silent and self.history:
            self.history.record(self.execution_count, code)
        self._allow_stdin = allow_stdin  # raw_input()/getpass() check it, as under ipykernel
        out = CellOutput(self._send_iopub, in_place=self._frontend_updates_in_place())
        try:
            session = await self._interruptible(self._ensure_session(out))
        except SessionError as exc:
            return self._fail("SandboxUnavailable", str(exc))
        except WaitInterrupted:
            return self._fail("KeyboardInterrupt", "interrupted: the sandbox is still starting; "
                              "run a cell when you want it")
        magics = SandboxMagics(session, out)
        payload: list[dict[str, Any]] = []
        for segment in split_cell(code):
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
            watch = PIP_COMMAND.search(segment.text) is not None
            refused_before = await self._best_effort(magics.refusals_so_far()) if watch else None
            reply = await self._run_code(session, segment.text, silent, store_history, out)
            if refused_before is not None:
                await self._best_effort(magics.show_refusals_since(refused_before))
            if reply["status"] != "ok":
                return reply
            payload += reply["payload"]
        return self._ok(payload)

    async def _run_code(self, session: SandboxSession, code: str, silent: bool,
                        store_history: bool, out: CellOutput) -> dict[str, Any]:
        cell_id = uuid.uuid4().hex
        translate = self.last_cell = _EventTranslator(self, session, cell_id)
        try:
            done = await session.run_cell(
                cell_id, code, translate.handle, silent=silent, store_history=store_history,
                execution_count=self.execution_count if not silent else None,
                on_resume=lambda: out.progress(f"Sandbox {session.sandbox_id} was paused: resuming…"))
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
            # exit() in the cell: a frontend such as jupyter console ends its session.
            return self._ok([{"source": "ask_exit", "keepkernel": False}] if translate.asked_exit else [])
        error = translate.last_error or {"ename": "Error", "evalue": "", "traceback": []}
        return {"status": "error", "execution_count": self.execution_count, **error}

    async def _background_event(self, event: dict[str, Any]) -> None:
        """Runner output between cells: on the last cell's parent, within its output cap."""
        if self.last_cell is not None and event.get("type") != "input_request":
            await self.last_cell.handle(event)

    @staticmethod
    async def _best_effort(work: Coroutine[Any, Any, T]) -> T | None:
        """An extra the cell can do without (naming egress refusals): failures are logged."""
        try:
            return await work
        except (SandboxAPIError, SessionError) as exc:
            log.warning("skipped: %s", exc)
            return None

    def _ok(self, payload: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        return {"status": "ok", "execution_count": self.execution_count,
                "payload": payload or [], "user_expressions": {}}

    def _fail(self, ename: str, message: str) -> dict[str, Any]:
        """One clear line in the cell (no traceback: the user did nothing wrong in Python)."""
        self.send_response(self.iopub_socket, "stream",
                           {"name": "stderr", "text": f"sandbox-kernel: {message}\n"})
        return {"status": "error", "execution_count": self.execution_count,
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

    async def _interruptible(self, work: Coroutine[Any, Any, T]) -> T:
        """Await work; an interrupt meanwhile raises WaitInterrupted (work is cancelled)."""
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
        """Run coro on the shell's event loop (control messages arrive on another thread)."""
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
        return {"status": "ok", "found": reply.get("found", False),
                "data": reply.get("data", {}), "metadata": reply.get("metadata", {})}

    async def _runner_query(self, message: dict[str, Any]) -> dict[str, Any]:
        """Completion and inspection are best effort: an empty answer beats an error popup."""
        if self.boot is None or not self.boot.done() or self.boot.exception() or self.sandbox is None:
            return {}
        try:
            return await self.sandbox.runner_request(message)
        except Exception as exc:
            log.warning("%s failed: %s", message[protocol.OP], exc)
            return {}

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
        # Report the sandbox's Python, so wait (briefly) for the sandbox to be up.
        if self.boot is not None and not self.boot.done():
            boot = self.boot
            await self._on_main_loop(asyncio.wait([boot], timeout=KERNEL_INFO_WAIT))
        await super().kernel_info_request(stream, ident, parent)

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
        return {"status": "ok", "restart": restart}

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
        if not connection_file:
            return None
        key = hashlib.sha256(str(Path(connection_file).resolve()).encode()).hexdigest()[:24]
        return state_dir() / "handoff" / f"{key}.json"

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


class _EventTranslator:
    """Turns one cell's runner events into iopub messages (and stdin requests)."""

    def __init__(self, kernel: SandboxKernel, session: SandboxSession, cell_id: str) -> None:
        self.kernel = kernel
        self.session = session
        self.cell_id = cell_id
        self.last_error: dict[str, Any] | None = None
        self.asked_exit = False
        self.input_tasks: list[asyncio.Task[None]] = []
        self.guard = OutputGuard(session.settings.output_limit)
        # Its cell's request: events that come after the cell (from a background thread)
        # still belong to it. The events are handled in the channel's reader task, whose
        # context is not the cell's: stdin requests are made in the cell's (ipykernel
        # keeps the parent and its ident in context variables).
        self.parent = kernel.get_parent("shell")
        self.context = contextvars.copy_context()

    def _send(self, _: Any, msg_type: str, content: dict[str, Any]) -> None:
        self.kernel.session.send(self.kernel.iopub_socket, msg_type, content, self.parent)

    async def handle(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        send = self._send
        iopub = self.kernel.iopub_socket
        if not self.guard.admit(event):
            notice = self.guard.notice()
            if notice:
                send(iopub, "stream", {"name": "stderr", "text": notice})
        elif kind == "stream":
            send(iopub, "stream", {"name": event["name"], "text": event["text"]})
        elif kind in ("display_data", "update_display_data"):
            send(iopub, kind, {"data": event["data"], "metadata": event.get("metadata", {}),
                               "transient": event.get("transient", {})})
        elif kind == "clear_output":
            send(iopub, "clear_output", {"wait": event.get("wait", False)})
        elif kind == "execute_result":
            send(iopub, "execute_result", {"execution_count": self.kernel.execution_count,
                                           "data": event["data"], "metadata": event.get("metadata", {})})
        elif kind == "error":
            self.last_error = {"ename": event["ename"], "evalue": event["evalue"],
                               "traceback": event["traceback"]}
            send(iopub, "error", self.last_error)
        elif kind == "ask_exit":
            self.asked_exit = True
        elif kind == "input_request":
            # Don't block the event stream while the user types.
            self.input_tasks.append(self.context.run(asyncio.get_running_loop().create_task,
                                                     self._ask(event.get("prompt", ""), event.get("password", False))))

    async def _ask(self, prompt: str, password: bool) -> None:
        ask = self.kernel.getpass if password else self.kernel.raw_input
        try:
            value: str | None = await asyncio.to_thread(ask, prompt)
        except Exception:  # StdinNotImplementedError, or the frontend went away
            value = None
        await self.session.send_input(self.cell_id, value)

    def flush_input_tasks(self) -> None:
        for task in self.input_tasks:
            task.cancel()


def main() -> None:
    from ipykernel.kernelapp import IPKernelApp

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    IPKernelApp.launch_instance(kernel_class=SandboxKernel)


if __name__ == "__main__":
    main()
