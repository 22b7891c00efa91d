"""%sandbox and %egress magics, handled on the host: they drive the sandbox through the
API and are never sent into it.

A cell is split into top-level magic lines and the code between them; they run in
order, so `x = 1` / `%sandbox pause` pauses after x is set.
"""

from __future__ import annotations

import argparse
import html
import posixpath
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandbox_kernel.api import egress_rules, names
from sandbox_kernel.kernel import magic_words
from sandbox_kernel.sandbox import ownership
from sandbox_kernel.api import EgressView, SandboxView
from sandbox_kernel.sandbox.listing import describe_age, describe_seconds
from sandbox_kernel.config import SHUTDOWN_POLICIES
from sandbox_kernel.sandbox.cost import Cost
from sandbox_kernel.kernel.magic_words import Word
from sandbox_kernel.kernel.output import CellOutput, html_without_math
from sandbox_kernel.kernel.output_safety import OutputFilter
from sandbox_kernel.sandbox.session import SandboxSession
from sandbox_kernel.sandbox.transfer import (
    CHUNK,
    MAX_FILE,
    WORKSPACE,
    Transfer,
    TransferError,
    describe_size,
    host_path,
    sandbox_path,
)

MAGIC = "%sandbox"
EGRESS = "%egress"
UPLOAD = "%upload"
DOWNLOAD = "%download"
# CreateOS has no deny-all token (an empty list allows all): one rule that matches nothing
# useful, a port on a documentation-only address (RFC 5737), stands for "block all".
BLOCK_ALL = egress_rules.DENY_ALL
SHOWN_REFUSALS = 3  # egress refusals named with their reason after a cell, at most
HELP = """\
%sandbox — manage this notebook's sandbox (handled by the kernel, not run in the sandbox)

  %sandbox status                 id, state, shape, age and origin of this notebook's sandbox
  %sandbox list                   every sandbox of this provider, with names and owners
  %sandbox pause                  freeze the sandbox (memory and files kept, compute stops)
  %sandbox resume                 continue a paused sandbox (running a cell also resumes it)
  %sandbox fork [--name N] [--switch]
                                  copy this sandbox, live Python state and files included, into
                                  a new one (pausing it first); --switch makes this notebook
                                  drive the copy; N names it for %sandbox attach from any
                                  notebook. Forks are this notebook's: its on-shutdown
                                  policy applies to them, and they pause after 10 min idle
  %sandbox attach ID|NAME [--destroy-previous] [--restart-runner]
                                  drive that sandbox from this notebook; the previous one
                                  stays (this notebook's policy still applies to it at
                                  shutdown) unless --destroy-previous; --restart-runner
                                  (or --fresh) starts this version's Python runner in it
                                  instead of keeping the one running there and its
                                  variables (also on the sandbox this notebook drives)
  %sandbox keep [ID|NAME]         hand a sandbox of this notebook (default: the one it
                                  drives) off: shutdown leaves it alone, gc too
  %sandbox cost                   what this notebook's sandboxes (forks included) have cost
                                  so far on CreateOS prices, running and paused
  %sandbox on-shutdown destroy|pause|keep
                                  what closing this notebook does to its sandboxes (the ones
                                  it created or forked and did not keep)
  %sandbox trust-output on|off    on: the sandbox's output reaches this page unchanged, its
                                  scripts run with your Jupyter rights (this kernel's life);
                                  off (default): scripts and active HTML are held back or
                                  shown in an isolated frame
  %sandbox help                   this text; %sandbox COMMAND --help: that command only

  %upload LOCAL [REMOTE], %download REMOTE [LOCAL]: copy files in and out (%upload help)
  %egress: the sandbox's outbound network allowlist (%egress help)
"""
EGRESS_HELP = """\
%egress — the sandbox's outbound network allowlist (enforced outside the sandbox)

  %egress                         the rules, and recent refused connections
  %egress allow RULE...           add rules
  %egress deny RULE...            remove rules
  %egress only RULE...            replace all rules with these
  %egress block-all               no outbound connection at all
  %egress open                    allow every public destination (host, private and
                                  link-local addresses still need a rule)
  %egress help                    this text; %egress COMMAND --help: that command only

A RULE is host, host:port, *.domain (subdomains), an IPv4/IPv6 address or a CIDR, e.g.
example.com  api.example.com:443  *.example.org  127.0.0.1:8000  10.0.0.0/8
or a preset: pypi (the Python package index and its file host, for pip).
Changes apply to the next connection; an empty list means every public destination.
"""


TRANSFER_HELP = f"""\
%upload, %download — copy files between this machine and the sandbox (files API)

  %upload LOCAL [REMOTE]          a file or a directory from this machine into the sandbox
  %download REMOTE [LOCAL]        a file or a directory from the sandbox to this machine

A relative LOCAL is in the notebook's directory, a relative REMOTE under {WORKSPACE}; REMOTE
defaults to {WORKSPACE}/<name>, LOCAL to ./<name>. Existing files are overwritten. Files up
to {describe_size(MAX_FILE)} each; large ones move in {describe_size(CHUNK)} pieces, with a progress line.
"""


class MagicError(Exception):
    """A mistake in a magic line; the message is one line for the user."""


@dataclass
class Segment:
    """A run of code lines, or one magic line, of a cell."""

    magic: bool
    text: str


def split_cell(code: str) -> list[Segment]:
    segments: list[Segment] = []
    for line in code.splitlines(keepends=True):
        if is_magic_line(line):
            segments.append(Segment(True, line.strip()))
        elif segments and not segments[-1].magic:
            segments[-1].text += line
        else:
            segments.append(Segment(False, line))
    return [s for s in segments if s.magic or s.text.strip()]


def is_magic_line(line: str) -> bool:
    return any(line.startswith(name) and line[len(name):len(name) + 1] in ("", " ", "\t", "\n", "\r")
               for name in (MAGIC, EGRESS, UPLOAD, DOWNLOAD))


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise MagicError(f"{self.prog}: {message} (see {self.prog.split()[0]} help)")


def help_for(text: str, prog: str, words: list[str]) -> str | None:
    """The help a line like `%sandbox fork --help` asks for (that command's entry), the whole
    text for `%sandbox --help`, or None when the line does not ask for help."""
    if "-h" not in words and "--help" not in words:
        return None
    command = words[0] if words and not words[0].startswith("-") else None
    if command is None:
        return text
    entry: list[str] = []
    for line in text.splitlines(keepends=True):
        if line.startswith(f"  {prog} {command} ") or line.rstrip() == f"  {prog} {command}":
            entry.append(line)
        elif entry and line.startswith(" " * 30):  # the entry's continuation lines
            entry.append(line)
        elif entry:
            break
    return "".join(entry) or text


def build_egress_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=EGRESS, add_help=False)
    sub = parser.add_subparsers(dest="command")
    for name in ("show", "block-all", "open", "help"):
        sub.add_parser(name, add_help=False)
    for name in ("allow", "deny", "only"):
        sub.add_parser(name, add_help=False).add_argument("rules", nargs="+", metavar="RULE")
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="%sandbox", add_help=False)
    sub = parser.add_subparsers(dest="command")
    for name in ("status", "list", "pause", "resume", "cost", "help"):
        sub.add_parser(name, add_help=False)
    fork = sub.add_parser("fork", add_help=False)
    fork.add_argument("--name")
    fork.add_argument("--switch", action="store_true")
    attach = sub.add_parser("attach", add_help=False)
    attach.add_argument("sandbox_id", metavar="ID|NAME")
    attach.add_argument("--destroy-previous", action="store_true")
    attach.add_argument("--restart-runner", "--fresh", dest="restart_runner", action="store_true")
    keep = sub.add_parser("keep", add_help=False)
    keep.add_argument("sandbox_id", metavar="ID|NAME", nargs="?")
    policy = sub.add_parser("on-shutdown", add_help=False)
    policy.add_argument("policy", choices=SHUTDOWN_POLICIES)
    sub.add_parser("trust-output", add_help=False).add_argument("trust", choices=("on", "off"))
    return parser


PARSER = build_parser()
EGRESS_PARSER = build_egress_parser()


def status_rows(view: SandboxView, provider: str, policy: str, cost: Cost,
                egress: list[str]) -> list[tuple[str, str]]:
    return [("id", view.id), ("name", names.display_name(view)), ("state", view.status.value),
            ("provider", provider),
            ("shape", f"{view.shape or '?'} ({view.vcpu} vCPU, {view.mem_mib} MiB)"),
            ("rootfs", view.rootfs or "the provider's default"),
            # the local engine says which limits this host enforces; CreateOS is a VM of the shape
            ("limits", view.limits or "the VM's own (CreateOS)"),
            ("age", describe_age(view.created_at)), ("forked from", view.forked_from or "—"),
            ("auto-pause", f"after {describe_seconds(view.auto_pause_after_seconds)} idle"
             if view.auto_pause_after_seconds else "off"),
            ("egress", describe_rules(egress)), ("on shutdown", policy), ("cost so far", describe_cost(cost))]


def describe_cost(cost: Cost) -> str:
    return (f"${cost.total:.4f} (running {describe_seconds(cost.running_seconds)}, "
            f"paused {describe_seconds(cost.paused_seconds)})")


def table(rows: list[tuple[str, ...]]) -> dict[str, str]:
    """A mime bundle: an HTML table for notebooks, aligned text for everything else. The
    first column is the label; a row may have more cells than another (each column is as
    wide as its widest cell that is not the last of its row)."""
    columns = max(len(row) for row in rows)
    widths = [max((len(row[i]) for row in rows if len(row) > i + 1), default=0) for i in range(columns)]
    text = "\n".join("  ".join([*(f"{cell:<{widths[i]}}" for i, cell in enumerate(row[:-1])), row[-1]])
                     for row in rows)

    def last(row: tuple[str, ...]) -> str:  # a short row's last cell spans the columns it lacks
        span = columns - len(row) + 1
        return (f"<td colspan='{span}'>" if span > 1 else "<td>") + f"{html.escape(row[-1])}</td>"

    body = "".join("<tr>" + f"<th style='text-align:left'>{html.escape(row[0])}</th>"
                   + "".join(f"<td>{html.escape(cell)}</td>" for cell in row[1:-1]) + last(row) + "</tr>"
                   for row in rows)
    return {"text/plain": text, "text/html": html_without_math(f"<table>{body}</table>")}


class SandboxMagics:
    def __init__(self, session: SandboxSession, out: CellOutput, output_filter: OutputFilter | None = None) -> None:
        self.session = session
        self.out = out
        self.output_filter = output_filter or OutputFilter()

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
            if event.get("type") == "stream" and event.get("name") == "stdout" and size <= magic_words.MAX_ANSWER:
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
        words = await self.words(prog, line[len(prog):])
        if prog in (UPLOAD, DOWNLOAD):
            await self.transfer(prog, words)
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
            await getattr(self, "egress_" + (args.command or "show").replace("-", "_"))(args)
            return
        args = PARSER.parse_args(typed)
        command = "help" if args.command is None else args.command
        handler = getattr(self, "do_" + command.replace("-", "_"))
        await handler(args)

    async def do_help(self, _: argparse.Namespace) -> None:
        self.out.text(HELP)

    async def do_status(self, _: argparse.Namespace) -> None:
        view = await self.session.view()
        cost = self.session.meter.cost(view.id)
        policy = (self.session.on_shutdown if ownership.owns(view.id)
                  else "keep (not this notebook's: it was attached or kept)")
        egress = (await self.session.get_egress()).egress or []
        rows = status_rows(view, self.session.settings.description, policy, cost, egress)
        rows.append(("output", "trusted: shown unchanged, scripts run" if self.output_filter.trusted
                     else "filtered: scripts and active HTML held back or isolated"))
        self.out.display(table(rows))

    async def do_cost(self, _: argparse.Namespace) -> None:
        costs = await self.session.costs()
        rows = [(c.sandbox_id + (" (this notebook)" if c.sandbox_id == self.session.sandbox_id else ""),
                 describe_cost(c)) for c in costs]
        rows.append(("total", f"${sum(c.total for c in costs):.4f}"))
        book = self.session.meter.prices
        rows.append(("prices", f"CreateOS, {book.dated}: ${book.vcpu_hour}/vCPU-h running, "
                               f"${book.memory_gib_hour}/GiB-h memory running or paused, "
                               f"${book.storage_gb_hour}/GB-h disk"))
        if self.session.settings.provider == "local":
            rows.append(("note", "local sandboxes are free: this is what they would cost on CreateOS"))
        self.out.display(table(rows))

    async def do_list(self, _: argparse.Namespace) -> None:
        views = await self.session.list_sandboxes()
        if not views:
            self.out.text(f"no sandboxes on {self.session.settings.description}\n")
            return
        rows = [(v.id + (" (this notebook)" if v.id == self.session.sandbox_id else ""),
                 f"{names.display_name(v)}, {v.status.value}, {v.shape or '?'}, {describe_age(v.created_at)} old"
                 + (f", forked from {v.forked_from}" if v.forked_from else "")
                 + f", owner: {ownership.describe_owner(v.id, v.name)}" + self._outlives(v.id))
                for v in views]
        self.out.display(table(rows))

    def _outlives(self, sandbox_id: str) -> str:
        """The mark of a sandbox that will still exist (and cost) after this notebook: kept
        ones, and this notebook's own when its policy pauses or keeps them. At shutdown the
        kernel's last words list them again, but JupyterLab shows no output then."""
        if ownership.is_kept(sandbox_id):
            return f"; KEPT: outlives its notebook (sandbox-kernel rm {sandbox_id} destroys it)"
        if self.session.on_shutdown != "destroy" and ownership.owns(sandbox_id):
            return f"; outlives this notebook (on shutdown: {self.session.on_shutdown})"
        return ""

    async def do_pause(self, _: argparse.Namespace) -> None:
        await self._transition("Pausing", self.session.pause, "paused")

    async def do_resume(self, _: argparse.Namespace) -> None:
        await self._transition("Resuming", self.session.resume, "running again")

    async def _transition(self, verb: str, action, outcome: str) -> None:  # type: ignore[no-untyped-def]
        started = time.monotonic()
        line = self.out.progress(f"{verb} sandbox {self.session.sandbox_id}…")
        await action(line)
        line.update(f"Sandbox {self.session.sandbox_id} {outcome} ({time.monotonic() - started:.1f} s)")

    async def do_fork(self, args: argparse.Namespace) -> None:
        started = time.monotonic()
        parent = self.session.sandbox_id
        line = self.out.progress(f"Forking sandbox {parent}…")
        paused_first = ""

        def pausing_first(text: str) -> None:  # on the fork's own line, so the result stays last
            nonlocal paused_first
            paused_first = f"; {parent} was paused first"
            line.headline = text
            line.update(text)

        child = await self.session.fork(args.name, progress=line, on_pause=pausing_first)
        label = f" ({args.name})" if args.name else ""
        line.update(f"Forked {parent} into {child.id}{label} in {time.monotonic() - started:.1f} s{paused_first}")
        ref = args.name or child.id
        if args.switch:
            await self.session.attach(child.id, progress=line)
            self.out.text(f"This notebook now drives the fork {child.id}; the original {parent} stays "
                          f"paused (%sandbox attach {parent} to go back)\n")
        else:
            self.out.text(f"{parent} stays paused until your next cell. Open the fork from another "
                          f"notebook with `%sandbox attach {ref}`, or start a kernel with "
                          f"SANDBOX_KERNEL_SANDBOX_ID={ref}\n")

    async def do_attach(self, args: argparse.Namespace) -> None:
        previous = self.session.sandbox_id
        args.sandbox_id = (await self.session.find(args.sandbox_id)).id
        if args.sandbox_id == previous:
            if not args.restart_runner:
                raise MagicError(f"%sandbox attach: this notebook already drives {previous}")
            line = self.out.progress(f"Restarting the Python runner in sandbox {previous}…")
            await self.session.attach(previous, fresh_runner=True, progress=line)
            line.update(f"Restarted the Python runner in sandbox {previous}: variables and imports "
                        "are gone, files are kept")
            return
        line = self.out.progress(f"Attaching to sandbox {args.sandbox_id}…")
        kept = await self.session.attach(args.sandbox_id, fresh_runner=args.restart_runner, progress=line)
        state = "its Python state kept" if kept else "a fresh Python started"
        line.update(f"This notebook now drives sandbox {args.sandbox_id} ({state})")
        if other_version := self.session.other_version_line():
            self.out.text(other_version + "\n")
        if previous and args.destroy_previous:
            await self.session.destroy(previous)
            self.out.text(f"Destroyed the previous sandbox {previous}\n")
        elif previous:
            self.out.text(f"The previous sandbox {previous} stays "
                          f"(%sandbox attach {previous} to go back)\n")

    async def do_keep(self, args: argparse.Namespace) -> None:
        view = await self.session.find(args.sandbox_id) if args.sandbox_id else await self.session.view()
        if not ownership.owns(view.id):
            raise MagicError(f"%sandbox keep: {view.id} is not this notebook's to hand off "
                             "(it was attached, or is kept already)")
        ownership.keep(view.id)
        self.session.kept.append(view.id)
        self.out.text(f"Sandbox {view.id} ({names.display_name(view)}) is kept: it outlives this notebook "
                      f"and gc leaves it; `sandbox-kernel rm {view.id}` destroys it\n")

    async def do_on_shutdown(self, args: argparse.Namespace) -> None:
        self.session.on_shutdown = args.policy
        outcome = {"destroy": "destroyed", "pause": "paused", "keep": "kept"}[args.policy]
        owned = ownership.owned_here()
        which = (f"sandbox {owned[0]}" if len(owned) == 1 else
                 f"its sandboxes {', '.join(owned)}" if owned else "no sandbox (it owns none)")
        self.out.text(f"When this notebook shuts down, {which} will be {outcome}\n")

    async def do_trust_output(self, args: argparse.Namespace) -> None:
        self.output_filter.trusted = args.trust == "on"
        if self.output_filter.trusted:
            self.out.text("Warning: the sandbox's output now runs in this page with your Jupyter rights "
                          "(it can read and change your files); `%sandbox trust-output off` ends that\n",
                          name="stderr")
        else:
            self.out.text("The sandbox's output is filtered again: scripts and active HTML are held back "
                          "or shown in an isolated frame\n")

    # -- %upload, %download ---------------------------------------------------------------

    async def transfer(self, prog: str, words: list[Word]) -> None:
        upload = prog == UPLOAD
        if not words or words[0].text in ("help", "-h", "--help"):
            self.out.text(TRANSFER_HELP)
            return
        if len(words) > 2 or words[0].is_option():
            raise MagicError(f"{prog}: expected {'LOCAL [REMOTE]' if upload else 'REMOTE [LOCAL]'} "
                             f"(see {prog} help)")
        source, target = words[0], words[1] if len(words) == 2 else None
        name = posixpath.basename(source.text.rstrip("/")) or source.text
        # The host side: LOCAL as given, or (downloading) the remote's name, which a value
        # of the sandbox may have chosen too.
        local = source if upload else target or Word(name, source.from_sandbox)
        try:
            magic_words.check_host_path(local, Path.cwd())
        except magic_words.MagicLineError as exc:
            raise MagicError(f"{prog}: {exc}") from None
        source_text, target_text = source.text, target.text if target else None
        await self._running()
        line_out = self.out.progress(f"{'Uploading' if upload else 'Downloading'} {source_text}…")
        assert self.session.client is not None and self.session.sandbox_id is not None  # started
        work = Transfer(self.session.client, self.session.sandbox_id, line_out)
        try:
            if upload:
                done = await work.upload(host_path(source_text), sandbox_path(target_text or name))
            else:
                done = await work.download(sandbox_path(source_text), host_path(target_text) if target_text else None)
        except TransferError as exc:
            line_out.update(f"{prog} {source_text}: failed")
            raise MagicError(f"{prog}: {exc}") from None
        except OSError as exc:  # this machine's side: permissions, a full disk...
            line_out.update(f"{prog} {source_text}: failed")
            raise MagicError(f"{prog}: {exc.strerror or exc}: {exc.filename or source_text}") from None
        line_out.update(done)

    async def _running(self) -> None:
        """The files API wants a running sandbox: resume a paused one, saying so."""
        view = await self.session.view()
        if view.status.is_pause_like:
            await self._transition("Resuming", self.session.resume, "running again")

    # -- %egress ------------------------------------------------------------------------

    async def egress_help(self, _: argparse.Namespace) -> None:
        self.out.text(EGRESS_HELP)

    async def egress_show(self, _: argparse.Namespace) -> None:
        view = await self.session.get_egress()
        rows: list[tuple[str, ...]] = [("rules", describe_rules(view.egress or []))]
        if view.denied_count is not None:
            rows.append(("refused", f"{view.denied_count} connection(s)"))
            rows += [(d.at[11:19], f"{d.host}:{d.port}", d.reason) for d in (view.denied or [])[-10:]]
        self.out.display(table(rows))

    async def egress_allow(self, args: argparse.Namespace) -> None:
        current = (await self.session.get_egress()).egress or []
        rules, narrowed = egress_rules.allowing(current, checked(args.rules))
        await self._set_rules(rules, note=" (was: all public destinations; every other destination "
                              "is now refused)" if narrowed else "")

    async def egress_deny(self, args: argparse.Namespace) -> None:
        gone = checked(args.rules)
        current = (await self.session.get_egress()).egress or []
        absent = egress_rules.missing(current, gone)
        if absent:
            raise MagicError(f"%egress deny: not in the rules: {' '.join(absent)}")
        remaining = egress_rules.remove(current, gone)
        if not remaining:
            raise MagicError("%egress deny: removing the last rule would allow every public destination; "
                             "use %egress block-all or %egress open")
        await self._set_rules(remaining)

    async def egress_only(self, args: argparse.Namespace) -> None:
        await self._set_rules(checked(args.rules))

    async def egress_block_all(self, _: argparse.Namespace) -> None:
        await self._set_rules([BLOCK_ALL])

    async def egress_open(self, _: argparse.Namespace) -> None:
        self.out.text("Warning: every public destination is now reachable from the sandbox "
                      "(the host, private and link-local addresses still need a rule)\n", name="stderr")
        await self._set_rules([])

    def show_refusals(self, view: EgressView, before: int) -> None:
        """Name the refusals the view has since `before`, then one line that would permit them
        all: a client shows little of why (pip says 'no matching distribution', urllib
        'Tunnel connection failed: 403 Forbidden')."""
        new = (view.denied_count or 0) - before
        recent = (view.denied or [])[-new:] if new > 0 else []
        targets = list(dict.fromkeys(f"{denial.host}:{denial.port}" for denial in recent))
        if not targets:
            return
        shown: set[str] = set()
        for denial in reversed(recent):  # the last reason of each destination, at most SHOWN_REFUSALS
            where = f"{denial.host}:{denial.port}"
            if where not in shown and len(shown) < SHOWN_REFUSALS:
                shown.add(where)
                self.out.text(f"sandbox-kernel: egress refused {where}: {denial.reason}\n", name="stderr")
        # The names come from the sandbox (what it asked to reach): only a host or an address
        # that is a rule as it stands goes into a line the user may copy (the engine's proxy
        # already answers a CIDR or wildcard target with 400, unrecorded: this does not rely on it).
        rules = list(dict.fromkeys(preset_of(target) or target for target in targets if egress_rules.is_one_destination(target)))
        if not rules:
            return
        self.out.text(f"sandbox-kernel: %egress allow {' '.join(rules)} permits "
                      f"{'it' if len(targets) == 1 else 'them'}\n", name="stderr")

    async def _set_rules(self, rules: list[str], note: str = "") -> None:
        view: EgressView = await self.session.set_egress(rules)
        self.out.text(f"egress: {describe_rules(view.egress or [])}{note}\n")


def checked(rules: list[str]) -> list[str]:
    """Validated before any request, with a one-line reason naming the bad rule."""
    try:
        return egress_rules.typed(rules)
    except egress_rules.EgressRuleError as exc:
        raise MagicError(f"%egress: {exc}") from None


def preset_of(target: str) -> str | None:
    """The preset whose rules allow `target` (host:port as refused), so the hint names the
    whole index rather than the one host of it that this cell happened to try first."""
    return next((name for name, rules in egress_rules.presets().items() if target.lower() in rules), None)


def describe_rules(rules: list[str]) -> str:
    if not rules:
        return "all public destinations (no rules)"
    if rules == [BLOCK_ALL]:
        return "nothing: all outbound connections blocked"
    return "only " + ", ".join(rules)
