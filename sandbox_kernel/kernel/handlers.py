"""SandboxKernel: an ipykernel Kernel whose cells run in a sandbox.

The kernel is its handler table: each shell and control message type it handles itself is
mapped to the handler of the module whose one job it is (SHELL_HANDLERS, CONTROL_HANDLERS).
The other message types keep ipykernel's handler (connect, shutdown, complete, inspect,
history, is_complete, debug), which calls this class's do_* hook where there is one to
answer (do_complete, do_debug_request...), itself handed to those modules:

  boot.py        the sandbox's start (early start, restart hand-off, progress line)
  execute.py     a cell: magic lines on the host, code in the sandbox, its reply
  events.py      the runner's events -> IOPub (and input requests -> stdin.py)
  comms.py       the frontend's comm messages, in order, to the comm manager in the sandbox
  subshells.py   kernel subshells, here and in the runner
  debug.py       debug_request and the debugger's events, within their budget
  interrupts.py  interrupt_request and SIGINT: a wait cut short, or the cell interrupted
  queries.py     completion, inspection, is_complete
  usage.py       usage_request: the sandbox's CPU and memory
  shutdown.py    shutdown, restart (handoff.py), a runner's death

Control messages and subshells' messages are handled on threads of their own, each with its
own loop; the sandbox session lives on the shell's (on_main_loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import signal
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

from ipykernel import kernel_protocol_version
from ipykernel.kernelbase import Kernel
from traitlets import Unicode

from sandbox_kernel import __version__
from sandbox_kernel.config import ConfigError, Settings
from sandbox_kernel.guest import protocol
from sandbox_kernel.kernel.boot import Boot
from sandbox_kernel.kernel.comms import DISPATCHED_CONCURRENTLY, CommRelay
from sandbox_kernel.kernel.debug import DebugRelay
from sandbox_kernel.kernel.early_cell import EarlyCells
from sandbox_kernel.kernel.events import EventRouting
from sandbox_kernel.kernel.execute import CellExecutor
from sandbox_kernel.kernel.handoff import RestartHandoff
from sandbox_kernel.kernel.interrupts import Interrupts
from sandbox_kernel.kernel.output_safety import OutputFilter
from sandbox_kernel.kernel.queries import CodeQueries
from sandbox_kernel.kernel.request_context import CELL_COUNT, REQUEST_PARENT
from sandbox_kernel.kernel.shutdown import Shutdown
from sandbox_kernel.kernel.subshells import Subshells
from sandbox_kernel.kernel.usage import UsageReporter
from sandbox_kernel.paths import state_dir
from sandbox_kernel.sandbox.session import SandboxSession

if TYPE_CHECKING:
    from sandbox_kernel.kernel.history import History

log = logging.getLogger("sandbox_kernel.kernel.handlers")

# Options a kernel argument can set (--SandboxKernel.<name>=...); they win over the
# environment and the config file.
KERNEL_ARGUMENTS = ("sandbox_id", "sandbox_name", "on_shutdown", "egress", "shape", "rootfs", "auto_pause",
                    "disk_mib", "env", "warm_pool")
# The message types this kernel handles itself, on the shell channel and on the control
# channel, by the name of their handler (an attribute path from the kernel). ipykernel
# handles the rest (connect, shutdown, complete...), calling the do_* hooks below.
SHELL_HANDLERS = {
    "execute_request": "execute_request",
    "kernel_info_request": "kernel_info_request",
    "interrupt_request": "interrupts.request",
    "comm_info_request": "comms.info_request",
    **{msg_type: "comms.from_frontend" for msg_type in protocol.COMM_MESSAGES},
}
CONTROL_HANDLERS = {
    **{msg_type: handler for msg_type, handler in SHELL_HANDLERS.items() if msg_type not in protocol.COMM_MESSAGES},
    "usage_request": "usage.request",
    "create_subshell_request": "subshells.create_request",
    "delete_subshell_request": "subshells.delete_request",
    "list_subshell_request": "subshells.list_request",
}
# kernel_info's supported_features, each with the messages it needs handled here (a feature
# is advertised only where the sandbox has it: see kernel_info).
FEATURE_MESSAGES = {
    "kernel subshells": ("create_subshell_request", "delete_subshell_request", "list_subshell_request"),
    "debugger": ("debug_request",),  # ipykernel's handler, which calls do_debug_request
}

Handler = Callable[[Any, Any, dict[str, Any]], Awaitable[None]]


class SandboxKernel(Kernel):
    """ipykernel's Kernel with the handlers of SHELL_HANDLERS and CONTROL_HANDLERS, and the
    do_* hooks of the messages ipykernel handles, answered for the sandbox."""

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
    disk_mib = Unicode("", help="disk of the sandbox the kernel creates, in MiB (default: the shape's)"
                       ).tag(config=True)
    env = Unicode("", help="names of the kernel's environment variables to hand to the sandbox it creates"
                  ).tag(config=True)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        settings: Settings | None = None
        config_error: str | None = None
        try:
            settings = Settings.from_env(kernel_args={name: getattr(self, name) for name in KERNEL_ARGUMENTS})
        except ConfigError as exc:
            config_error = str(exc)
        self.settings = settings
        self.main_loop: asyncio.AbstractEventLoop | None = None
        # What of the sandbox's output may reach the page (%sandbox trust-output), for this
        # kernel's life: a restart filters again.
        self.output_filter = OutputFilter()
        self.handoff = RestartHandoff(getattr(self.parent, "connection_file", None))
        self.boot = Boot(self, settings, config_error)
        self.events = EventRouting(self)
        self.cells = CellExecutor(self)
        self.interrupts = Interrupts(self)
        self.queries = CodeQueries(self)
        self.comms = CommRelay(self)
        self.subshells = Subshells(self)
        self.debugger = DebugRelay(self)
        self.usage = UsageReporter(self)
        self.shutdown = Shutdown(self)
        self.cells_executing = 0  # execute_requests being handled (comms.py announces by it)
        self.early_cells = EarlyCells(self)
        self.main_shell_messages = 0  # being handled or waiting their turn (shell_main)
        # The (sub)shells whose failed cell had its queue aborted before the reply (see _abort_queues).
        self.queues_aborted_early: set[str | None] = set()
        # The count each execute_input showed, by request, until its do_execute takes it.
        self.announced_counts: dict[str, int] = {}
        self.shell_handlers.update(self.bind_handlers(SHELL_HANDLERS))
        self.control_handlers.update(self.bind_handlers(CONTROL_HANDLERS))

    @functools.cached_property
    def history(self) -> History | None:
        """The input history, opened at its first use (a cell's record, made once the cell's
        request is on its way; a history request), not at start: sqlite3's import and the
        file's opening took 5-10 ms of the kernel's start. None if it cannot be opened."""
        from sandbox_kernel.kernel.history import open_history

        return open_history(state_dir() / "history.sqlite")

    def record_input(self, line: int, source: str) -> None:
        """Keep a cell's source in the input history (when there is one)."""
        if self.history:
            self.history.record(line, source)

    def bind_handlers(self, table: dict[str, str]) -> dict[str, Handler]:
        """The handlers a table names, bound to this kernel's modules."""
        bound: dict[str, Handler] = {}
        for msg_type, path in table.items():
            target: Any = self
            for name in path.split("."):
                target = getattr(target, name)
            bound[msg_type] = target
        return bound

    @property
    def sandbox(self) -> SandboxSession | None:
        """This notebook's sandbox session, once its start began (not `self.session`: that
        name is jupyter_client's Session in ipykernel)."""
        return self.boot.session

    def start(self) -> None:
        # Before ipykernel's start: it opens the control channel, whose thread may then handle
        # a request (a usage panel asking at once) that needs the main loop.
        self.main_loop = asyncio.get_event_loop()
        super().start()
        # interrupt_mode is "message", but a frontend may still send SIGINT: forward it.
        signal.signal(signal.SIGINT, lambda *_: self.main_loop.call_soon_threadsafe(self.interrupts.interrupt_soon))
        self.boot.begin(self.main_loop)

    async def on_main_loop(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run coro on the shell's event loop, where the sandbox session, its channel and
        their futures and locks live: control messages and subshells' messages are handled
        on threads of their own, each with its own loop."""
        assert self.main_loop is not None
        if asyncio.get_running_loop() is self.main_loop:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.main_loop))

    # -- the request being handled ----------------------------------------------------------

    def request_parent(self) -> dict[str, Any]:
        """The message the output being sent belongs to (see request_context.REQUEST_PARENT)."""
        return REQUEST_PARENT.get(None) or self.get_parent("shell")

    def cell_count(self) -> int:
        """The execution count of the cell being handled (see request_context.CELL_COUNT)."""
        return CELL_COUNT.get(self.execution_count)

    def subshell_id(self) -> str | None:
        """The subshell of the request being handled (None: the main shell)."""
        subshell_id = self.request_parent().get("header", {}).get("subshell_id")
        return subshell_id if isinstance(subshell_id, str) else None

    def parent_msg_id(self) -> str:
        """The id of the request being handled: its output in the sandbox goes out with this
        parent, and ipywidgets' Output widget there captures output by it."""
        return str(self.request_parent().get("header", {}).get("msg_id", ""))

    def send_iopub(self, msg_type: str, content: dict[str, Any], metadata: dict[str, Any] | None = None) -> None:
        self.session.send(self.iopub_socket, msg_type, content, self.request_parent(), metadata=metadata)

    def runner_offers(self, feature: str) -> bool:
        """The sandbox is up, a channel reaches its runner, and the runner says it has `feature`."""
        return (self.boot.ready() and self.sandbox is not None and self.sandbox.has_channel
                and self.sandbox.runner_info.get(feature) is True)

    # -- shell messages ---------------------------------------------------------------------

    async def shell_main(self, subshell_id, msg):  # type: ignore[no-untyped-def]
        """A shell message as it arrives: with no other main-shell message being handled or
        waiting, a cell that would run at once is sent to the sandbox now (early_cell.py)."""
        if subshell_id is not None:
            return await super().shell_main(subshell_id, msg)
        sent = None if self.main_shell_messages else self.early_cells.send(msg)
        self.main_shell_messages += 1
        try:
            await super().shell_main(subshell_id, msg)
        finally:
            self.main_shell_messages -= 1
            if sent is not None:
                self.early_cells.forget(sent)

    async def dispatch_shell(self, msg, /, subshell_id=None, *, concurrent=False):  # type: ignore[no-untyped-def]
        """Each message is handled in a context of its own. ipykernel runs all of a shell's
        messages in one shared context, and when a comm message it dispatched concurrently
        ends, it sets that context's parent back to the one it saw when it began. Here comm
        handlers take a round trip, so a message handled in turn may have begun meanwhile:
        it then published its idle under the restored (earlier) parent, and the frontend
        never saw this message go idle (ipywidgets' page stopped sending changes).

        A request whose cell went ahead to the local engine is dispatched once the engine has
        handed the cell on (early_cell.py)."""
        if not concurrent and subshell_id is None:
            await self.early_cells.before_dispatch(msg)
        context = contextvars.copy_context()
        context.run(DISPATCHED_CONCURRENTLY.set, concurrent)
        await asyncio.create_task(super().dispatch_shell(msg, subshell_id=subshell_id, concurrent=concurrent),
                                  context=context)

    async def execute_request(self, stream, ident, parent):  # type: ignore[no-untyped-def]
        """ipykernel's, counted until answered (shutdown.py), a subshell's tracked (subshells.py)."""
        with self.shutdown.counted(), self.subshells.tracked(parent):
            return await super().execute_request(stream, ident, parent)

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
            reply = await self.on_main_loop(
                self.cells.execute(code, silent, store_history, user_expressions or {}, allow_stdin))
        except asyncio.CancelledError:
            raise  # this very request was cancelled: its loop is closing, no reply can leave
        except Exception as exc:  # a bug of ours, or a magic that raised: one line, and the reply
            log.exception("execute_request failed in the kernel")
            reply = self.cells.fail("SandboxError", f"internal error ({type(exc).__name__}: {exc}); "
                                    "details are in the kernel's log")
        finally:
            self.cells_executing -= 1
            # A request the kernel dies in the middle of is closed when it is collected, in
            # another context, where its tokens cannot be reset (a ValueError logged at exit).
            with contextlib.suppress(ValueError):
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

    async def do_complete(self, code: str, cursor_pos: int) -> dict[str, Any]:
        return await self.queries.complete(code, cursor_pos)

    async def do_inspect(self, code: str, cursor_pos: int, detail_level: int = 0,
                         omit_sections: Any = ()) -> dict[str, Any]:
        return await self.queries.inspect(code, cursor_pos, detail_level)

    async def do_is_complete(self, code: str) -> dict[str, Any]:
        return self.queries.is_complete(code)

    async def do_history(self, hist_access_type: str, output: bool, raw: bool,
                         **request: Any) -> dict[str, Any]:
        entries = self.history.reply(hist_access_type, output, **request) if self.history else []
        return {"status": "ok", "history": entries}

    # -- control messages -------------------------------------------------------------------

    async def do_debug_request(self, msg: dict[str, Any]) -> dict[str, Any]:
        return await self.debugger.request(msg)

    async def do_shutdown(self, restart: bool) -> dict[str, Any]:
        return await self.shutdown.do_shutdown(restart)

    # -- kernel info ------------------------------------------------------------------------

    async def kernel_info_request(self, stream, ident, parent):  # type: ignore[no-untyped-def]
        await self.boot.wait_briefly()  # to report the sandbox's Python and what it can do
        await super().kernel_info_request(stream, ident, parent)

    def supported_features(self) -> list[str]:
        """The features of FEATURE_MESSAGES the sandbox has now."""
        available = {"kernel subshells": self.subshells.available(), "debugger": self.debugger.available()}
        return [feature for feature in FEATURE_MESSAGES if available[feature]]

    @property
    def kernel_info(self) -> dict[str, Any]:  # type: ignore[override]
        # Not ipykernel's: to list "debugger" and "kernel subshells" (its own machinery) it
        # imports its debugger and debugpy into this process, 65 ms or more on the first
        # kernel_info, which a starting notebook waits for. Only what reaches into the
        # sandbox is advertised, where the sandbox has it.
        features = self.supported_features()
        return {"protocol_version": kernel_protocol_version, "implementation": self.implementation,
                "implementation_version": self.implementation_version, "language_info": self.language_info,
                "banner": self.banner, "help_links": self.help_links,
                "supported_features": features, "debugger": "debugger" in features}

    @property
    def banner(self) -> str:  # type: ignore[override]
        """kernel_info's banner: where cells run, once the sandbox is up."""
        if not self.boot.ready():
            return self.base_banner
        return f"{self.base_banner}\n{self.boot.ready_line()}"

    @property
    def language_info(self) -> dict[str, Any]:  # type: ignore[override]
        version = ""
        if self.sandbox is not None:
            version = self.sandbox.runner_info.get("python_version", "")
        return {"name": "python", "version": version, "mimetype": "text/x-python",
                "file_extension": ".py", "pygments_lexer": "ipython3",
                "codemirror_mode": {"name": "ipython", "version": 3},
                "nbconvert_exporter": "python"}
