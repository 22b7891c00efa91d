"""The IPython engine: cells run in a full IPython InteractiveShell (magics, ``!cmd``, rich
display, IPython tracebacks) whose output machinery emits the cell's events, with
ipykernel's shell API (parents, payloads, %edit, an interruptible pdb).

Imported only where the sandbox's Python has IPython.
"""
from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import os
import re
import sys
import threading
import typing

from .. import protocol
from . import OWN_FILES
from .loop import CellTask
from .output import OutputRouter, ParentRequests
from .plain import ends_with_semicolon

if typing.TYPE_CHECKING:
    from IPython.core.interactiveshell import ExecutionResult


class IPythonEngine:
    """Runs cells with a full IPython InteractiveShell (magics, ``!cmd``, rich
    display, IPython tracebacks) whose output machinery emits events."""

    def __init__(self, router: OutputRouter, parents: ParentRequests):
        import IPython

        self.ipython_version = IPython.__version__
        self._count = 0
        self._emit = router.emit
        self.shell = _build_shell(router.emit, lambda: self._count, parents)

    def reset_after_fork(self) -> None:
        # The history manager's locks may have been held by the parent's main thread.
        history = self.shell.history_manager
        for name in ("db_input_cache_lock", "db_output_cache_lock"):
            if hasattr(history, name):
                setattr(history, name, threading.Lock())

    @property
    def execution_count(self) -> int:
        return self.shell.execution_count

    @execution_count.setter
    def execution_count(self, count: int) -> None:
        self.shell.execution_count = count
        # Numbers the kernel gave to cells that did not run here (its own magics, an empty
        # cell): blank history entries, so that In[n], %history and %recall n find cell n.
        history = self.shell.history_manager
        for inputs in (history.input_hist_parsed, history.input_hist_raw):
            inputs.extend([""] * (count - len(inputs)))

    async def run(self, code: str, silent: bool, store_history: bool, count: int) -> bool:
        """Run a cell on the daemon's event loop: a cell with top-level await as a task
        (what ipykernel does), any other synchronously."""
        self._count = count
        shell = self.shell
        shell.displayhook_failed = False
        shell.error_shown = False
        if _may_await(code):
            result = await self._run_maybe_async(code, silent, store_history)
        else:
            # run_cell transforms and compiles the cell to tell whether it awaits: doing it
            # here first as well was work twice on every cell's way to its first output
            # (for a four-line print loop, 0.19 ms to transform and 0.05 ms to compile,
            # timed outside the sandbox).
            result = shell.run_cell(code, store_history=store_history, silent=silent)
        error = result.error_before_exec or result.error_in_exec
        if error is not None and not shell.error_shown:
            # Its traceback's display was cut short (IPython prints just "KeyboardInterrupt"
            # when a second interrupt lands while it formats the first error): the error is
            # still said, named from the exception, as ipykernel names it whatever its display did.
            self._emit(protocol.ERROR_EVENT, ename=type(error).__name__, evalue=_text_of(error), traceback=[])
        # An error formatting the cell's result fails the cell, as under ipykernel.
        return result.success and not shell.displayhook_failed

    async def _run_maybe_async(self, code: str, silent: bool, store_history: bool) -> ExecutionResult:
        """A cell that may await: as a task if it does, else synchronously; its ExecutionResult."""
        from IPython.core.interactiveshell import _asyncio_runner

        shell = self.shell
        try:
            transformed, transform_error = shell.transform_cell(code), None
        except Exception:
            transformed, transform_error = code, sys.exc_info()
        if not (shell.loop_runner is _asyncio_runner and shell.should_run_async(
                code, transformed_cell=transformed, preprocessing_exc_tuple=transform_error)):
            return shell.run_cell(code, store_history=store_history, silent=silent)
        result = None
        try:
            result = await CellTask.run(shell.run_cell_async(
                code, store_history=store_history, silent=silent, transformed_cell=transformed,
                preprocessing_exc_tuple=transform_error))
        finally:  # what run_cell does after run_cell_async
            shell.events.trigger("post_execute")
            if not silent:
                shell.events.trigger("post_run_cell", result)
        return result

    def user_expressions(self, expressions: dict) -> dict:
        return self.shell.user_expressions(expressions)

    def take_payload(self) -> list:
        """What the cell asked of the frontend (pager, next input): the execute_reply's payload."""
        payload = self.shell.payload_manager.read_payload()
        self.shell.payload_manager.clear_payload()
        return payload

    def complete(self, code: str, cursor_pos: int) -> dict:
        # The provisional completions API (what ipykernel uses): unlike the
        # older shell.complete() it still finds user names when jedi is installed.
        from IPython.core.completer import provisionalcompleter, rectify_completions

        with provisionalcompleter():
            completions = list(rectify_completions(code, self.shell.Completer.completions(code, cursor_pos)))
        start, end = (completions[0].start, completions[0].end) if completions else (cursor_pos, cursor_pos)
        return {"matches": [completion.text for completion in completions], "cursor_start": start,
                "cursor_end": end, "metadata": {}}

    def inspect(self, code: str, cursor_pos: int, detail_level: int) -> dict:
        from IPython.utils.tokenutil import token_at_cursor

        name = token_at_cursor(code, cursor_pos)
        try:
            bundle = self.shell.object_inspect_mime(name, detail_level=detail_level)
        except KeyError:
            return {"found": False, "data": {}, "metadata": {}}
        bundle.pop("text/html", None)  # like ipykernel without an HTML pager
        return {"found": True, "data": bundle, "metadata": {}}


def _text_of(error: BaseException) -> str:
    """str(error), or "" where that fails (or is interrupted) again."""
    try:
        return str(error)
    except BaseException:  # noqa: BLE001 - a user's __str__ may raise anything, KeyboardInterrupt too
        return ""


def _may_await(code: str) -> bool:
    """Whether the cell may await at top level, which it can only with `await`, `async for`
    or `async with` in its text (IPython's transforms add none). False means run_cell's
    synchronous runner; True, the exact check (should_run_async)."""
    return "await" in code or "async" in code


def _build_shell(emit, current_count, parents: ParentRequests):
    """An InteractiveShell whose displays, results and tracebacks become events
    (the same hooks ipykernel's ZMQInteractiveShell uses), with ipykernel's shell API
    that tells which request output goes to (get_parent, set_parent, set_thread_parent)."""
    from IPython.core.displayhook import DisplayHook
    from IPython.core.displaypub import DisplayPublisher
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets import Type
    from traitlets.config import Config

    class EventDisplayPublisher(DisplayPublisher):
        def publish(self, data, metadata=None, source=None, *, transient=None, update=False, **kwargs):
            emit(protocol.UPDATE_DISPLAY_DATA if update else protocol.DISPLAY_DATA,
                 data=data, metadata=metadata or {}, transient=transient or {})

        def clear_output(self, wait=False):
            emit(protocol.CLEAR_OUTPUT, wait=bool(wait))

    class EventDisplayHook(DisplayHook):
        """The value of a cell's last expression becomes an execute_result."""

        _bundle = None  # while formatting a result

        def start_displayhook(self):
            self._bundle = ({}, {})

        def write_output_prompt(self):
            pass  # no "Out[N]:" text: the count travels in the event

        def write_format_data(self, format_dict, md_dict=None):
            self._bundle = (format_dict, md_dict or {})

        def finish_displayhook(self):
            data, metadata = self._bundle
            self._bundle = None
            if data:
                emit(protocol.EXECUTE_RESULT, execution_count=current_count(), data=data, metadata=metadata)

        def quiet(self):
            # The base class looks at the history, which cells run with
            # store_history=False never reach; look at this cell instead.
            if self.exec_result is None:
                return super().quiet()
            return ends_with_semicolon(self.exec_result.info.raw_cell)

    class EventShell(InteractiveShell):
        displayhook_class = Type(EventDisplayHook)
        display_pub_class = Type(EventDisplayPublisher)
        displayhook_failed = False  # a result's formatting raised, in the cell running now

        def init_hooks(self):
            super().init_hooks()
            # `obj?`, `%pdoc`, `%pinfo`...: a `page` payload for the frontend's pager.
            self.set_hook("show_in_pager", _page_payload, 99)

        def set_next_input(self, s, replace=False):
            # `%load`, `%recall`: the frontend puts the text in the next input (or this one).
            self.payload_manager.write_payload({"source": "set_next_input", "text": s, "replace": replace})

        def _showtraceback(self, etype, evalue, stb):
            if self.displayhook._bundle is not None:
                self.displayhook_failed = True
            # IPython always shows the frame that raised, even a runner one (input()
            # without a frontend, say): drop every frame of the runner's.
            user_frames = [entry for entry in stb if OWN_FILES not in re.sub(r"\x1b\[[0-9;]*m", "", entry)]
            emit(protocol.ERROR_EVENT, ename=etype.__name__, evalue=str(evalue), traceback=user_frames)
            self.error_shown = True

        def ask_exit(self):
            # exit()/quit() in a cell must not end the daemon; the frontend is told
            # instead (an ask_exit payload), as ipykernel does.
            emit(protocol.ASK_EXIT)

        def get_parent(self):
            return parents.get_parent()

        def set_parent(self, parent):
            parents.set_parent(parent)

        def set_thread_parent(self, parent):
            return parents.set_thread_parent(parent)

        def reset_thread_parent(self, token):
            parents.reset_thread_parent(token)

        def enable_gui(self, gui=None):
            if gui not in (None, "inline"):
                raise NotImplementedError("GUI event loop %r is not available in the sandbox" % gui)

    config = Config()
    config.HistoryManager.hist_file = ":memory:"  # no sqlite file, no history-saving thread
    shell = EventShell.instance(config=config)
    InterruptiblePdbOnImport.install()
    _register_edit_magic(shell)
    return shell


def _register_edit_magic(shell) -> None:
    """%edit (and its alias %ed) as under ipykernel: no editor in the sandbox to wait for (IPython's own
    would start one without a terminal), so the frontend is told which file to open, an
    `edit_magic` payload, and nothing runs. The path is the sandbox's."""
    from IPython.core.magic import Magics, line_magic, magics_class
    from IPython.core.magics.code import CodeMagics, MacroToEdit

    @magics_class
    class EditMagics(Magics):
        @line_magic
        def edit(self, parameter_s=""):
            opts, args = self.parse_options(parameter_s, "prn:")
            try:
                filename, line_number, _ = CodeMagics._find_edit_target(self.shell, args, opts, ["", ""])
            except MacroToEdit:
                print("%edit of a macro is not available in a kernel")
                return
            self.shell.payload_manager.write_payload({"source": "edit_magic", "line_number": line_number,
                                                      "filename": os.path.abspath(filename)})

    shell.register_magics(EditMagics)


def _page_payload(shell, data, start=0, screen_lines=0):
    """The show_in_pager hook: text or a mime bundle for the frontend's pager."""
    bundle = dict(data) if isinstance(data, dict) else {"text/plain": str(data)}
    bundle.pop("text/html", None)  # no HTML pager, as in ipykernel by default
    shell.payload_manager.write_payload({"source": "page", "data": bundle, "start": start})


class InterruptiblePdbOnImport(importlib.abc.MetaPathFinder):
    """pdb.set_trace() and breakpoint() get IPython's debugger that an interrupt ends (plain
    pdb would swallow the KeyboardInterrupt and the cell would never end). Applied when pdb
    or IPython's debugger is first imported, by whatever imports it (a cell's `import pdb`,
    breakpoint(), %debug), not at start: an idle runner never needs them (~0.4 MiB PSS)."""

    MODULES = ("pdb", "IPython.core.debugger")

    @classmethod
    def install(cls) -> None:
        if any(name in sys.modules for name in cls.MODULES):
            _use_interruptible_pdb()
        else:
            sys.meta_path.insert(0, cls())

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.MODULES:
            return None
        # Both are modules of files on the path (path: the parent package's, or None for sys.path).
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run_module = spec.loader.exec_module

        def run_then_patch(module) -> None:
            run_module(module)
            # pdb imported by IPython's debugger, which is still running: patched when it is done.
            if fullname == "pdb" and "IPython.core.debugger" in sys.modules:
                return
            with contextlib.suppress(ValueError):  # done once
                sys.meta_path.remove(self)
            _use_interruptible_pdb()

        spec.loader.exec_module = run_then_patch
        return spec


def _use_interruptible_pdb() -> None:
    """What InterruptiblePdbOnImport applies: pdb's debugger and set_trace are IPython's interruptible one."""
    import pdb

    from IPython.core import debugger

    if hasattr(debugger, "InterruptiblePdb"):
        debugger.Pdb = debugger.InterruptiblePdb
        pdb.Pdb = debugger.InterruptiblePdb
        pdb.set_trace = debugger.set_trace
