"""`sandbox-kernel sweep NOTEBOOK -p NAME VALUE [VALUE ...]`: run a notebook once up to its
parameters cell, then the rest once per combination of values, each in a fork of that live
sandbox, several at once.

The setup part runs on a kernel of its own (the source), in a sandbox named for this sweep.
Its sandbox is forked once per combination (sandbox/sweep.py); each fork gets a kernel
attached to it (SANDBOX_KERNEL_SANDBOX_ID's kernel argument), so its Python goes on from the
setup's state; the values are injected as papermill injects them (a cell tagged
`injected-parameters` after the cell tagged `parameters`), and the rest of the notebook runs
there. Ownership (ownership.py): the source kernel owns each fork from its first moment, the
branch's kernel once it is up, and its shutdown destroys it; the sweep destroys what is left.
Each branch's notebook is written to the output directory, and a summary (parameters,
status, duration, the --collect variables) is printed and written as CSV and HTML.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import csv
import html
import importlib.util
import io
import os
import re
import secrets
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandbox_kernel.api import SandboxView
from sandbox_kernel.config import Settings
from sandbox_kernel.sandbox import ownership
from sandbox_kernel.sandbox.sweep import (CANCELLED, FAILED, OK, Branch, Outcome, SweepError, combinations, grid_of,
                                          parameter_source, sweep)
from sandbox_kernel.sandbox.sealed import allowed_env, kernel_arguments, sealed_options

PARAMETERS_TAG = "parameters"
INJECTED_TAG = "injected-parameters"
# Kernels on this machine cost CPU only for their own bookkeeping on CreateOS, where the
# branches compute remotely: more of them at once than there are cores.
CREATEOS_JOBS_PER_CORE = 4
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
CELL_WIDTH = 40  # characters of a value in the printed table
SPREADSHEET_FORMULA = re.compile(r"^[=+@\t\r]|^-(?![0-9.])")


@dataclass(frozen=True)
class Plan:
    """What runs where: cells [0, fork_at] in the source, the rest in every branch, the
    injected cell at `inject_at` (an index into the rest)."""
    notebook: Any  # nbformat.NotebookNode, its outputs cleared
    fork_at: int
    inject_at: int


def plan(nb: Any, fork_after: str | None) -> Plan:
    """Where the notebook forks and where the values go, or SweepError."""
    for cell in nb.cells:  # outputs saved in the file must not pass for this run's
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nb.cells = [cell for cell in nb.cells if INJECTED_TAG not in cell.metadata.get("tags", [])]
    tagged = {tag: index for index, cell in reversed(list(enumerate(nb.cells)))
              for tag in cell.metadata.get("tags", [])}
    parameters = tagged.get(PARAMETERS_TAG)
    if fork_after is None:
        if parameters is None:
            raise SweepError(f"no cell is tagged {PARAMETERS_TAG!r}: tag the cell that sets the "
                             "parameters, or name the cell to fork after with --fork-after TAG")
        return Plan(nb, parameters, 0)
    if fork_after not in tagged:
        raise SweepError(f"--fork-after {fork_after}: no cell is tagged {fork_after!r}")
    fork_at = tagged[fork_after]
    if parameters is not None and parameters < fork_at:
        raise SweepError(f"--fork-after {fork_after}: that cell comes after the {PARAMETERS_TAG!r} cell, so "
                         "the cells between would run with the default values")
    return Plan(nb, fork_at, 0 if parameters is None else parameters - fork_at)


def file_names(stem: str, branches: Sequence[Branch]) -> list[str]:
    """One notebook file name per branch, from its parameters (unique, filesystem-safe)."""
    names: list[str] = []
    for branch in branches:
        words = "-".join(f"{name}={value}" for name, value in branch.parameters.items())
        name = re.sub(r"[^A-Za-z0-9._=+-]", "_", f"{stem}-{words}")[:120]
        names.append(f"{name}-{branch.index}.ipynb" if f"{name}.ipynb" in names else f"{name}.ipynb")
    return names


def branch_notebook(executed_source: Any, template: Plan, parameters: dict[str, Any]) -> Any:
    """A branch's notebook: the setup cells as the source ran them, the values injected,
    the rest to run."""
    import nbformat

    nb = copy.deepcopy(template.notebook)
    rest = nb.cells[template.fork_at + 1:]
    injected = nbformat.v4.new_code_cell(parameter_source(parameters), metadata={"tags": [INJECTED_TAG]})
    rest.insert(template.inject_at, injected)
    nb.cells = copy.deepcopy(executed_source.cells[:template.fork_at + 1]) + rest
    nb.metadata.setdefault("papermill", {})["parameters"] = parameters
    return nb


# -- kernels --------------------------------------------------------------------------------

@contextlib.asynccontextmanager
async def kernel(client: Any) -> AsyncIterator[int]:
    """Start the NotebookClient's kernel; yield its pid; shut it down gracefully (its shutdown
    policy runs) whatever happens. (nbclient's own setup_kernel replaces the SIGINT handler
    each time, so Ctrl-C would no longer cancel the sweep.)"""
    client.km = client.create_kernel_manager()
    try:
        await client.async_start_new_kernel()
        await client.async_start_new_kernel_client()
        pid = getattr(client.km.provisioner, "pid", None)
        if not isinstance(pid, int):
            raise RuntimeError("the kernel's process is not known: sweeps need a local kernel provisioner")
        yield pid
    finally:
        await asyncio.shield(_stop(client))


async def _stop(client: Any) -> None:
    if client.kc is not None:
        client.kc.stop_channels()
    if client.km is not None and client.km.has_kernel:
        await client.km.shutdown_kernel(now=False)


def _cell_error(exc: Exception, cell: Any) -> str:
    errors = [output for output in cell.get("outputs", []) if output.get("output_type") == "error"]
    if errors:
        return f"In [{cell.get('execution_count') or ' '}] {errors[-1]['ename']}: {errors[-1]['evalue']}"
    return f"In [{cell.get('execution_count') or ' '}] {getattr(exc, 'ename', None) or type(exc).__name__}"


async def _collect(client: Any, variables: Sequence[str]) -> dict[str, str]:
    """Each variable's repr in the kernel's Python (its error's name if it has none)."""
    if not variables:
        return {}
    msg_id = client.kc.execute("", silent=True, store_history=False,
                               user_expressions={name: name for name in variables})
    reply = await client.async_wait_for_reply(msg_id)
    found = (reply or {}).get("content", {}).get("user_expressions", {})
    return {name: (found.get(name, {}).get("data", {}).get("text/plain")
                   or f"<{found.get(name, {}).get('ename', 'missing')}>") for name in variables}


# -- the sweep --------------------------------------------------------------------------------

@dataclass
class Options:
    notebook: Path
    grid: dict[str, list[Any]]
    kernel_name: str
    output_dir: Path
    jobs: int | None
    collect: list[str]
    timeout: float
    fork_after: str | None
    allow_env: list[str]


async def run_sweep(options: Options, on_outcome: Callable[[Outcome], None],
                    on_total: Callable[[int], None]) -> tuple[list[Outcome], list[Branch]]:
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(options.notebook, as_version=4)
    template = plan(nb, options.fork_after)
    sealed = kernel_arguments(nb.metadata, allowed_env(options.allow_env))
    branches = combinations(options.grid)
    names = file_names(options.notebook.stem, branches)
    settings = _kernel_settings(options.kernel_name, sealed_options(nb.metadata))
    jobs = options.jobs or (os.cpu_count() or 1) * (CREATEOS_JOBS_PER_CORE if settings.provider == "createos" else 1)
    options.output_dir.mkdir(parents=True, exist_ok=True)
    resources = {"metadata": {"path": str(options.notebook.parent)}}
    source_name = f"sweep-{secrets.token_hex(4)}"

    source_nb = copy.deepcopy(nb)
    source_client = NotebookClient(source_nb, kernel_name=options.kernel_name, timeout=options.timeout,
                                   startup_timeout=options.timeout, resources=resources,
                                   extra_arguments=[*sealed, f"--SandboxKernel.sandbox_name={source_name}",
                                                    "--SandboxKernel.on_shutdown=destroy"])

    async def run_branch(branch: Branch, fork: SandboxView) -> Outcome:
        started = time.monotonic()
        branch_nb = branch_notebook(source_nb, template, branch.parameters)
        client = NotebookClient(branch_nb, kernel_name=options.kernel_name, timeout=options.timeout,
                                startup_timeout=options.timeout, resources=resources,
                                extra_arguments=[f"--SandboxKernel.sandbox_id={fork.id}",
                                                 "--SandboxKernel.on_shutdown=destroy"])
        outcome = Outcome(branch, OK)
        try:
            async with kernel(client) as pid:
                ownership.hand_over(fork.id, pid)  # the kernel attached to it: its shutdown destroys it
                for index in range(template.fork_at + 1, len(branch_nb.cells)):
                    try:
                        await client.async_execute_cell(branch_nb.cells[index], index)
                    except CellExecutionError as exc:
                        outcome = Outcome(branch, FAILED, error=_cell_error(exc, branch_nb.cells[index]))
                        break
                with contextlib.suppress(Exception):  # a dead kernel has nothing to give
                    outcome.collected = await _collect(client, options.collect)
        finally:
            nbformat.write(branch_nb, options.output_dir / names[branch.index])
        outcome.seconds = time.monotonic() - started
        return outcome

    async with kernel(source_client) as source_pid:
        for index in range(template.fork_at + 1):
            try:
                await source_client.async_execute_cell(source_nb.cells[index], index)
            except CellExecutionError as exc:
                raise SweepError(f"the setup failed before the fork: "
                                 f"{_cell_error(exc, source_nb.cells[index])}") from None
        from sandbox_kernel.sandbox.session import SandboxSession

        source = SandboxSession(settings)
        try:
            await source.observe(source_name)
            on_total(len(branches))
            outcomes = await sweep(source, branches, run_branch, jobs, owner=source_pid, on_outcome=on_outcome)
        finally:
            await source.close()
    return outcomes, branches


def _kernel_settings(kernel_name: str, sealed: dict[str, str]) -> Settings:
    """The settings the kernels will have (a kernelspec's env may choose the provider; the
    seal's auto-pause is the forks' too)."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        spec_env = KernelSpecManager().get_kernel_spec(kernel_name).env or {}
    except NoSuchKernel:
        raise SweepError(f"no kernelspec {kernel_name!r}: run `sandbox-kernel install` first") from None
    return Settings.from_env({**os.environ, **spec_env}, kernel_args=sealed)


# -- the summary ------------------------------------------------------------------------------

def summary_rows(outcomes: Sequence[Outcome], grid: dict[str, list[Any]],
                 collect: Sequence[str]) -> tuple[list[str], list[list[str]]]:
    header = ["#", *grid, "status", "seconds", *collect, "error"]
    rows = [[str(outcome.branch.index + 1), *(repr(outcome.branch.parameters[name]) for name in grid),
             outcome.status, f"{outcome.seconds:.1f}", *(outcome.collected.get(name, "") for name in collect),
             outcome.error or ""] for outcome in outcomes]
    return header, rows


def _terminal_safe(text: str) -> str:
    """Text from a sandbox, made harmless for a terminal and one cell wide."""
    text = CONTROL.sub(lambda match: repr(match.group())[1:-1], text)
    return text if len(text) <= CELL_WIDTH else text[:CELL_WIDTH - 1] + "…"


def text_table(header: list[str], rows: list[list[str]]) -> str:
    cells = [[_terminal_safe(value) for value in row] for row in [header, *rows]]
    widths = [max(len(row[column]) for row in cells) for column in range(len(header))]
    return "\n".join("  ".join(value.ljust(width) for value, width in zip(row, widths)).rstrip()
                     for row in cells) + "\n"


def csv_table(header: list[str], rows: list[list[str]]) -> str:
    """CSV; a value a spreadsheet would run as a formula is quoted with a leading '."""
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(header)
    writer.writerows([[f"'{value}" if SPREADSHEET_FORMULA.match(value) else value for value in row]
                      for row in rows])
    return out.getvalue()


def html_table(title: str, header: list[str], rows: list[list[str]]) -> str:
    def line(tag: str, values: list[str]) -> str:
        return "<tr>" + "".join(f"<{tag}>{html.escape(value)}</{tag}>" for value in values) + "</tr>"
    body = "\n".join(line("td", row) for row in rows)
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title></head>\n"
            f"<body><table border=\"1\">\n{line('th', header)}\n{body}\n</table></body></html>\n")


# -- the command ---------------------------------------------------------------------------------

def add_parser(sub: Any, add_allow_env: Callable[[argparse.ArgumentParser], None]) -> None:
    parser = sub.add_parser("sweep", help="run a notebook's setup once, then the rest once per combination "
                                          "of parameter values, each in a fork of the live sandbox")
    parser.add_argument("notebook", type=Path)
    parser.add_argument("-p", "--parameter", dest="parameters", action="append", nargs="+", default=[],
                        metavar=("NAME", "VALUE"), help="a parameter and its values (repeatable: "
                        "the sweep runs every combination)")
    parser.add_argument("--fork-after", metavar="TAG",
                        help="fork after the cell with this tag (default: the cell tagged parameters)")
    parser.add_argument("--jobs", type=int, help="branches at once (default: the cores, 4x that on CreateOS)")
    parser.add_argument("--output-dir", type=Path, help="where the executed notebooks and the summary go "
                        "(default: NOTEBOOK-sweep)")
    parser.add_argument("--collect", action="append", default=[], metavar="NAME",
                        help="show this variable of every branch in the summary (repeatable)")
    parser.add_argument("--kernel", default="sandbox", help="kernelspec name (default: sandbox)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per cell (default: 600)")
    add_allow_env(parser)
    parser.set_defaults(run=cmd_sweep)


def cmd_sweep(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("nbclient") is None or importlib.util.find_spec("nbformat") is None:
        print("sandbox-kernel sweep needs nbclient: pip install 'sandbox-kernel[examples]'", file=sys.stderr)
        return 2
    for name in args.collect:
        if not name.isidentifier():
            raise SweepError(f"--collect {name}: not a Python variable name")
    if args.jobs is not None and args.jobs < 1:
        raise SweepError("--jobs must be 1 or more")
    options = Options(notebook=args.notebook, grid=grid_of(args.parameters), kernel_name=args.kernel,
                      output_dir=args.output_dir or Path(f"{args.notebook.stem}-sweep"), jobs=args.jobs,
                      collect=args.collect, timeout=args.timeout, fork_after=args.fork_after,
                      allow_env=args.allow_env)
    progress = Progress()
    started = time.monotonic()
    outcomes: list[Outcome] = []
    try:
        outcomes, _ = asyncio.run(run_sweep(options, progress.done, progress.start))
    except KeyboardInterrupt:
        progress.close()
        print("sandbox-kernel sweep: interrupted; every fork was destroyed", file=sys.stderr)
        return 130
    progress.close()
    header, rows = summary_rows(outcomes, options.grid, options.collect)
    stem = options.output_dir / f"{options.notebook.stem}-summary"
    stem.with_suffix(".csv").write_text(csv_table(header, rows))
    stem.with_suffix(".html").write_text(html_table(f"sweep of {options.notebook.name}", header, rows))
    failed = [outcome for outcome in outcomes if outcome.status != OK]
    print(text_table(header, rows), end="")
    print(f"{len(outcomes) - len(failed)} of {len(outcomes)} branches ok"
          + (f", {len(failed)} failed" if failed else "")
          + f" in {time.monotonic() - started:.1f} s; notebooks and {stem.name}.csv/.html in {options.output_dir}")
    return 1 if failed else 0


class Progress:
    """A bar (tqdm) in a terminal; elsewhere one line per finished branch. A failing branch
    is said at once, either way."""

    def __init__(self) -> None:
        self.bar: Any = None
        self.total = 0
        self.finished = 0

    def start(self, total: int) -> None:
        self.total = total
        if sys.stderr.isatty():
            with contextlib.suppress(ImportError):
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="branch", file=sys.stderr)

    def done(self, outcome: Outcome) -> None:
        self.finished += 1
        line = (f"[{self.finished}/{self.total}] {_terminal_safe(outcome.branch.label)}: {outcome.status} "
                f"({outcome.seconds:.1f} s)")
        if outcome.status in (FAILED, CANCELLED):
            line += f": {CONTROL.sub(' ', outcome.error or '')}"
        if self.bar is not None:
            if outcome.status != OK:
                self.bar.write(line, file=sys.stderr)
            self.bar.update(1)
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
