"""The plain engine: runs cells without IPython, where the sandbox has none.

Statements run in order, a final expression becomes the execute_result, top-level await
works, `!command` and `%pip` lines run in a shell, display() and the _repr_*_ methods give
rich output, and completion and inspection work from the user's names.
"""
from __future__ import annotations

import ast
import builtins
import inspect
import io
import linecache
import os
import re
import sys
import tokenize
import traceback
import types

from .. import protocol
from . import OWN_FILES
from .environment import importable
from .loop import CellTask
from .output import OutputRouter


def _mime_bundle(obj: object) -> dict:
    """Jupyter mime bundle of ``obj`` from its ``_repr_*_`` methods (IPython-less)."""
    data: dict = {}
    if not isinstance(obj, type):  # on a class these would be unbound methods
        mimebundle = getattr(obj, "_repr_mimebundle_", None)
        if callable(mimebundle):
            bundle = mimebundle(include=None, exclude=None)
            data.update(bundle[0] if isinstance(bundle, tuple) else bundle or {})
        for mime, method_name in _REPR_METHODS:
            method = getattr(obj, method_name, None)
            value = method() if callable(method) else None
            if isinstance(value, tuple):  # (data, metadata)
                value = value[0]
            if value is not None and mime not in data:
                data[mime] = value
    data.setdefault("text/plain", repr(obj))
    return data


_REPR_METHODS = (
    ("text/html", "_repr_html_"),
    ("text/markdown", "_repr_markdown_"),
    ("text/latex", "_repr_latex_"),
    ("image/svg+xml", "_repr_svg_"),
    ("image/png", "_repr_png_"),
    ("image/jpeg", "_repr_jpeg_"),
    ("application/json", "_repr_json_"),
    ("application/javascript", "_repr_javascript_"),
)


def ends_with_semicolon(code: str) -> bool:
    """True if the last token of the cell is ';' (which silences its result)."""
    skipped = (tokenize.ENDMARKER, tokenize.NEWLINE, tokenize.NL, tokenize.COMMENT,
               tokenize.INDENT, tokenize.DEDENT)
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(code).readline))
    except (tokenize.TokenError, SyntaxError):
        return False
    for token in reversed(tokens):
        if token.type not in skipped:
            return token.type == tokenize.OP and token.string == ";"
    return False


def _name_at(code: str, cursor_pos: int) -> str:
    """The dotted name under (or just before) the cursor; inside ``f(`` it is ``f``."""
    def is_name_char(char: str) -> bool:
        return char.isalnum() or char == "_"

    start = end = cursor_pos
    while end < len(code) and is_name_char(code[end]):
        end += 1
    while start > 0 and (is_name_char(code[start - 1]) or code[start - 1] == "."):
        start -= 1
    name = code[start:end].strip(".")
    if not name and cursor_pos > 0 and code[cursor_pos - 1] == "(":
        return _name_at(code, cursor_pos - 1)
    return name


# In the plain mode, lines in IPython's shell syntax: `!command` and `%pip ...`.
_SHELL_LINE_PATTERN = r"^([ \t]*)(!|%pip\b)(.*)$"


class PlainEngine:
    """Runs cells without IPython.

    Statements run in order; a final expression is evaluated and becomes the
    execute_result. Each cell gets a ``<cell-N>`` filename registered in
    linecache so tracebacks show its source, and the daemon's own frames are
    stripped from them. Open pyplot figures are shown as PNGs after each cell.
    """

    ipython_version = None

    def __init__(self, router: OutputRouter):
        self._router = router
        # A fresh __main__ module, so that pickling classes defined in cells works.
        main_module = types.ModuleType("__main__")
        main_module.__dict__["__builtins__"] = builtins
        sys.modules["__main__"] = main_module
        self.namespace = main_module.__dict__
        self.execution_count = 1  # the count the next stored cell gets
        self._cells_run = 0
        builtins.display = self.display
        builtins._sandbox_kernel_shell = _shell  # what `!command` lines become (_shell_call)
        builtins._sandbox_kernel_expand = _expand  # what the kernel's magics call for `{expr}`

    def reset_after_fork(self) -> None:
        pass

    async def run(self, code: str, silent: bool, store_history: bool, count: int) -> bool:
        self._cells_run += 1
        filename = "<cell-%d>" % self._cells_run
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        if store_history:
            self.execution_count += 1
        try:
            value = await self._execute(code, filename)
            if value is not None and not silent and not ends_with_semicolon(code):
                self.namespace["_"] = value
                self._router.emit(protocol.EXECUTE_RESULT, execution_count=count,
                                  data=_mime_bundle(value), metadata={})
            ok = True
        except BaseException:  # noqa: B902 - SystemExit and KeyboardInterrupt are user errors here
            self._report_error(*sys.exc_info())
            ok = False
        self._show_figures()
        return ok

    def user_expressions(self, expressions: dict) -> dict:
        """Each expression's value as a mime bundle, or its error (execute_reply's user_expressions)."""
        results = {}
        for key, expression in expressions.items():
            try:
                results[key] = {"status": "ok", "data": _mime_bundle(eval(expression, self.namespace)), "metadata": {}}
            except Exception as exc:
                results[key] = {"status": "error", "ename": type(exc).__name__, "evalue": str(exc),
                                "traceback": traceback.format_exception_only(type(exc), exc)}
        return results

    def take_payload(self) -> list:
        return []  # pager, set_next_input: IPython features

    def display(self, *objs: object, display_id: str | None = None, update: bool = False,
                metadata: dict | None = None, **_ignored: object) -> None:
        """The ``display()`` builtin of the IPython-less mode."""
        transient = {"display_id": display_id} if display_id else {}
        for obj in objs:
            self._router.emit(protocol.UPDATE_DISPLAY_DATA if update else protocol.DISPLAY_DATA,
                              data=_mime_bundle(obj), metadata=metadata or {}, transient=transient)

    def complete(self, code: str, cursor_pos: int) -> dict:
        start = cursor_pos
        while start > 0 and (code[start - 1].isalnum() or code[start - 1] in "_."):
            start -= 1
        text = code[start:cursor_pos]
        matches: list[str] = []
        if text:  # rlcompleter answers a tab character for empty text
            # Imported on first use: it loads readline too, which the IPython engine (that
            # imports this module) never needs.
            import rlcompleter

            completer = rlcompleter.Completer(self.namespace)
            try:
                for state in range(10000):
                    match = completer.complete(text, state)
                    if match is None:
                        break
                    match = match.rstrip("(")
                    if match not in matches:
                        matches.append(match)
            except Exception:  # e.g. the running cell changed the namespace under us
                pass
        return {"matches": matches, "cursor_start": start, "cursor_end": cursor_pos, "metadata": {}}

    def inspect(self, code: str, cursor_pos: int, detail_level: int) -> dict:
        name = _name_at(code, cursor_pos)
        try:
            obj = self._lookup(name)
        except (KeyError, AttributeError):
            return {"found": False, "data": {}, "metadata": {}}
        return {"found": True, "data": {"text/plain": _describe(name, obj, detail_level)}, "metadata": {}}

    def _lookup(self, dotted_name: str) -> object:
        """Resolve a dotted name by plain lookups (never evaluating code)."""
        if not dotted_name:
            raise KeyError(dotted_name)
        first, *rest = dotted_name.split(".")
        obj = self.namespace[first] if first in self.namespace else vars(builtins)[first]
        for attribute in rest:
            obj = getattr(obj, attribute)
        return obj

    async def _execute(self, code: str, filename: str) -> object:
        """Run the cell (top-level await allowed); return the value of its final expression, if any."""
        code = re.sub(_SHELL_LINE_PATTERN, _shell_call, code, flags=re.MULTILINE)
        # dont_inherit: this file's __future__ imports must not leak into user code.
        tree = compile(code, filename, "exec", ast.PyCF_ONLY_AST, dont_inherit=True)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        await self._evaluate(compile(tree, filename, "exec", ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True))
        if last is None:
            return None
        expression = ast.Expression(last.value)
        return await self._evaluate(compile(expression, filename, "eval", ast.PyCF_ALLOW_TOP_LEVEL_AWAIT,
                                            dont_inherit=True))

    async def _evaluate(self, compiled: types.CodeType) -> object:
        """Run compiled cell code; code with a top-level await is a coroutine to await."""
        outcome = eval(compiled, self.namespace)
        if compiled.co_flags & inspect.CO_COROUTINE:
            return await CellTask.run(outcome)
        return outcome

    def _report_error(self, etype: type, value: BaseException, tb: types.TracebackType | None) -> None:
        while tb is not None and tb.tb_frame.f_code.co_filename.startswith(OWN_FILES):
            tb = tb.tb_next  # the user's cell is where their traceback starts
        if issubclass(etype, SyntaxError):
            lines = traceback.format_exception_only(etype, value)
        else:
            lines = traceback.format_exception(etype, value, tb)
        self._router.emit(protocol.ERROR_EVENT, ename=etype.__name__, evalue=str(value),
                          traceback=[line.rstrip("\n") for line in lines])

    def _show_figures(self) -> None:
        """Emit open pyplot figures as PNG (what matplotlib-inline does with IPython)."""
        pyplot = sys.modules.get("matplotlib.pyplot")
        if pyplot is None:  # never import matplotlib on the user's behalf
            return
        try:
            for number in pyplot.get_fignums():
                figure = pyplot.figure(number)
                png = io.BytesIO()
                figure.savefig(png, format="png", bbox_inches="tight")
                self._router.emit(protocol.DISPLAY_DATA, data={"image/png": png.getvalue(), "text/plain": repr(figure)},
                                  metadata={}, transient={})
        except Exception:
            self._router.write("stderr", traceback.format_exc())
        finally:
            pyplot.close("all")


def _shell_call(match) -> str:
    """A `!command` or `%pip ...` line (IPython syntax) as a call of _shell, line numbers kept."""
    indent, escape, rest = match.groups()
    return "%s_sandbox_kernel_shell(%r, %r, globals())" % (indent, rest.strip(), escape == "%pip")


def _expand(line: str, names: dict) -> str:
    """`$name` and `{expr}` in a shell or magic line, evaluated in the user's names (IPython's
    var_expand, for the plain mode); as there, the line as it was when one fails."""
    try:
        named = re.sub(r"\$(\w+)", lambda m: str(names[m.group(1)]) if m.group(1) in names else m.group(0), line)
        return re.sub(r"\{([^{}]+)\}", lambda m: str(eval(m.group(1), names)), named)
    except Exception:
        return line


def _shell(command: str, pip: bool, names: dict) -> None:
    """`!command` and `%pip ...` in the plain mode: the shell runs them, their output is the
    cell's (fds 1 and 2). pip runs from the interpreter's bundled wheel (ensurepip) when the
    rootfs has no pip of its own."""
    import shlex
    import subprocess

    command = _expand(command, names)
    env = None
    if pip:
        command = "%s -m pip %s" % (shlex.quote(sys.executable), command)
        if not importable("pip"):
            wheel = _bundled_pip()
            if wheel is None:
                sys.stderr.write("pip is not available in this sandbox (no pip module, no ensurepip)\n")
                return
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([wheel, os.environ.get("PYTHONPATH", "")]))
    subprocess.run(command, shell=True, env=env)


def _bundled_pip() -> str | None:
    try:
        import ensurepip
    except ImportError:
        return None
    import glob

    # Debian's Python keeps the wheels its ensurepip installs in /usr/share/python-wheels, not
    # beside ensurepip.
    for place in (os.path.join(os.path.dirname(ensurepip.__file__), "_bundled"), "/usr/share/python-wheels"):
        wheels = sorted(glob.glob(os.path.join(place, "pip-*.whl")))
        if wheels:
            return wheels[-1]
    return None


def _describe(name: str, obj: object, detail_level: int) -> str:
    """pydoc-like text for inspect requests: signature, type, docstring (and source)."""
    lines = []
    try:
        lines.append("Signature: %s%s" % (name, inspect.signature(obj)))
    except (TypeError, ValueError):
        pass
    lines.append("Type:      %s" % type(obj).__name__)
    doc = inspect.getdoc(obj)
    if doc:
        lines.append("Docstring:\n" + doc)
    if detail_level:
        try:
            lines.append("Source:\n" + inspect.getsource(obj))
        except (OSError, TypeError):
            pass
    return "\n".join(lines)

