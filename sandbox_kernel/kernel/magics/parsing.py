"""Magic lines in a cell, and the %sandbox command line: what every magic family shares.

A cell is split into top-level magic lines and the code between them; they run in
order, so `x = 1` / `%sandbox pause` pauses after x is set.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from sandbox_kernel.config import SHUTDOWN_POLICIES

MAGIC = "%sandbox"
EGRESS = "%egress"
UPLOAD = "%upload"
DOWNLOAD = "%download"
MAGIC_NAMES = (MAGIC, EGRESS, UPLOAD, DOWNLOAD)
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
               for name in MAGIC_NAMES)


class MagicParser(argparse.ArgumentParser):
    """A magic's argument parser: a mistake is one MagicError line, never an exit."""

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


def code_after(line: str) -> tuple[str, str | None]:
    """A `%sandbox sweep ... -- CODE` line's options and its CODE (None without ` -- `): the
    code is Python, never split into words nor filled in."""
    options, dashes, code = line.partition(" -- ")
    return (options, code) if dashes else (line, None)


def build_parser() -> argparse.ArgumentParser:
    parser = MagicParser(prog=MAGIC, add_help=False)
    sub = parser.add_subparsers(dest="command")
    for name in ("status", "list", "pause", "resume", "cost", "seal", "help"):
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
    sweep = sub.add_parser("sweep", add_help=False)
    sweep.add_argument("-p", dest="parameters", nargs="+", action="append", metavar="NAME VALUE")
    sweep.add_argument("--jobs", type=int)
    sweep.add_argument("--keep", action="store_true")
    return parser


PARSER = build_parser()
