"""%egress: the sandbox's outbound network allowlist, shown and changed through the
session; and the lines that name the connections it refused during a cell."""

from __future__ import annotations

import argparse
from typing import Any

from sandbox_kernel.api import EgressView, egress_rules
from sandbox_kernel.kernel.egress_learning import EgressLearning, LearningNotSupported, suggested_rules
from sandbox_kernel.kernel.magics.family import MagicFamily
from sandbox_kernel.kernel.magics.parsing import EGRESS, MagicError, MagicParser
from sandbox_kernel.kernel.magics.tables import table
from sandbox_kernel.kernel.output import CellOutput
from sandbox_kernel.kernel.output_safety import OutputFilter
from sandbox_kernel.sandbox.session import SandboxSession

# CreateOS has no deny-all token (an empty list allows all): one rule that matches nothing
# useful, a port on a documentation-only address (RFC 5737), stands for "block all".
BLOCK_ALL = egress_rules.DENY_ALL
SHOWN_REFUSALS = 3  # egress refusals named with their reason after a cell, at most
EGRESS_HELP = """\
%egress — the sandbox's outbound network allowlist (enforced outside the sandbox)

  %egress                         the rules, and recent refused connections
  %egress allow RULE...           add rules
  %egress deny RULE...            remove rules
  %egress only RULE...            replace all rules with these
  %egress block-all               no outbound connection at all
  %egress open                    allow every public destination (host, private and
                                  link-local addresses still need a rule)
  %egress learn [--stop]          record every destination the cells reach (host, port,
                                  connections, cells), under the current rules; --stop
                                  ends it (local engine only)
  %egress suggest                 the narrowest `%egress only` line allowing what learn
                                  saw, as the next input (exact host:port, names as asked)
  %egress help                    this text; %egress COMMAND --help: that command only

A RULE is host, host:port, *.domain (subdomains), an IPv4/IPv6 address or a CIDR, e.g.
example.com  api.example.com:443  *.example.org  127.0.0.1:8000  10.0.0.0/8
or a preset: pypi (the Python package index and its file host, for pip).
Changes apply to the next connection; an empty list means every public destination.
"""


def build_egress_parser() -> argparse.ArgumentParser:
    parser = MagicParser(prog=EGRESS, add_help=False)
    sub = parser.add_subparsers(dest="command")
    for name in ("show", "block-all", "open", "suggest", "help"):
        sub.add_parser(name, add_help=False)
    for name in ("allow", "deny", "only"):
        sub.add_parser(name, add_help=False).add_argument("rules", nargs="+", metavar="RULE")
    sub.add_parser("learn", add_help=False).add_argument("--stop", action="store_true")
    return parser


EGRESS_PARSER = build_egress_parser()


class EgressMagics(MagicFamily):
    def __init__(self, session: SandboxSession, out: CellOutput, output_filter: OutputFilter,
                 payload: list[dict[str, Any]], learning: EgressLearning) -> None:
        super().__init__(session, out, output_filter, payload)
        self.learning = learning  # the kernel's, across cells

    async def help(self, _: argparse.Namespace) -> None:
        self.out.text(EGRESS_HELP)

    async def show(self, _: argparse.Namespace) -> None:
        view = await self.session.get_egress()
        rows: list[tuple[str, ...]] = [("rules", describe_rules(view.egress or []))]
        if view.denied_count is not None:
            rows.append(("refused", f"{view.denied_count} connection(s)"))
            rows += [(d.at[11:19], f"{d.host}:{d.port}", d.reason) for d in (view.denied or [])[-10:]]
        self.out.display(table(rows))

    async def allow(self, args: argparse.Namespace) -> None:
        current = (await self.session.get_egress()).egress or []
        rules, narrowed = egress_rules.allowing(current, checked(args.rules))
        await self._set_rules(rules, note=" (was: all public destinations; every other destination "
                              "is now refused)" if narrowed else "")

    async def deny(self, args: argparse.Namespace) -> None:
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

    async def only(self, args: argparse.Namespace) -> None:
        await self._set_rules(checked(args.rules))

    async def block_all(self, _: argparse.Namespace) -> None:
        await self._set_rules([BLOCK_ALL])

    async def open_to_all(self, _: argparse.Namespace) -> None:
        self.out.text("Warning: every public destination is now reachable from the sandbox "
                      "(the host, private and link-local addresses still need a rule)\n", name="stderr")
        await self._set_rules([])

    async def learn(self, args: argparse.Namespace) -> None:
        learning = self.learning
        if args.stop:
            if learning.sandbox_id is None:
                raise MagicError("%egress learn --stop: not learning (start with %egress learn)")
            learning.stop()
            self.out.text(f"egress learn: stopped; {len(learning.table)} destination(s) recorded "
                          "(%egress suggest writes the line that allows them)\n")
            if learning.table:
                self.out.display(table([("destination", "connections", "cells"), *learning.rows()]))
            return
        try:
            await learning.start(self.session)
        except LearningNotSupported as exc:
            raise MagicError(str(exc)) from None
        self.out.text(f"egress learn: recording the destinations the next cells reach, under the current "
                      f"rules ({describe_rules((await self.session.get_egress()).egress or [])}); "
                      "%egress suggest, %egress learn --stop\n")

    async def suggest(self, _: argparse.Namespace) -> None:
        if not self.learning.table:
            raise MagicError("%egress suggest: nothing recorded: run %egress learn, then the cells")
        rules, unspellable = suggested_rules(list(self.learning.table))
        if unspellable:
            self.out.text(f"sandbox-kernel: no rule names {', '.join(unspellable[:3])}"
                          f"{' …' if len(unspellable) > 3 else ''}: left out\n", name="stderr")
        if not rules:
            raise MagicError("%egress suggest: no recorded destination can be written as a rule")
        line = f"{EGRESS} only {' '.join(checked(rules))}"
        self.set_next_input(line)
        self.out.text(f"In the next input: {line}\n")

    async def _set_rules(self, rules: list[str], note: str = "") -> None:
        view: EgressView = await self.session.set_egress(rules)
        self.out.text(f"egress: {describe_rules(view.egress or [])}{note}\n")


def show_refusals(out: CellOutput, view: EgressView, before: int) -> None:
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
            out.text(f"sandbox-kernel: egress refused {where}: {denial.reason}\n", name="stderr")
    # The names come from the sandbox (what it asked to reach): only a host or an address
    # that is a rule as it stands goes into a line the user may copy (the engine's proxy
    # already answers a CIDR or wildcard target with 400, unrecorded: this does not rely on it).
    rules = list(dict.fromkeys(preset_of(target) or target for target in targets if egress_rules.is_one_destination(target)))
    if not rules:
        return
    out.text(f"sandbox-kernel: %egress allow {' '.join(rules)} permits "
             f"{'it' if len(targets) == 1 else 'them'}\n", name="stderr")


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
