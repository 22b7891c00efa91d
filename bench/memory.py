"""Memory of processes as the host sees it, from /proc/PID/smaps_rollup.

PSS (proportional set size) counts each resident page divided by the number of
processes mapping it: a shared library page used by 20 runners counts 1/20 in each. The
PSS of a set of processes therefore adds up honestly: summed over every process on the
machine it is the memory in use. RSS would count shared pages once per process.
Page cache of files read (not mapped) and kernel memory (page tables, sockets) are not
in either.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

KIB = 1024


def pss_bytes(pid: int) -> int:
    """The process's PSS in bytes (0 if it is gone)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * KIB
    return 0


def command_line(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    return ""


ROLES = ("bwrap", "agent", "warden", "runner", "relay")


def process_role(pid: int) -> str:
    """What a local sandbox's process is, from its command line: one of ROLES (the warden is
    the runner's parent, a shell whose script ends in guest/runner/warden.py; the relay, the
    kernel's handle on its channel to the runner, is a `cat` of a socket once it has handed
    its pipes to the runner), or "other" (what the user started)."""
    words = command_line(pid).split()
    names = [os.path.basename(word) for word in words]
    if not words:
        return "other"
    if names[0] == "bwrap":
        return "bwrap"
    if "run_agent.py" in names:
        return "agent"
    if "warden.py" in names:
        return "warden"
    if names == ["cat"] and _stdin(pid).startswith("socket:"):
        return "relay"
    if any(name == "runner" and following == "serve" for name, following in zip(names, words[1:])):
        return "runner"
    return "other"


def _stdin(pid: int) -> str:
    with contextlib.suppress(OSError):
        return os.readlink(f"/proc/{pid}/fd/0")
    return ""


def _parent_and_name(pid: int) -> tuple[int, str]:
    stat = Path(f"/proc/{pid}/stat").read_text()
    name = stat[stat.index("(") + 1:stat.rindex(")")]
    return int(stat[stat.rindex(")") + 2:].split()[1]), name


def sandbox_processes(sandbox_id: str) -> list[int]:
    """Host pids of a local sandbox: every process with SANDBOX_ID=<id> in its environment
    (agent, runner, whatever the user started) and the bwrap processes above them."""
    marker = f"SANDBOX_ID={sandbox_id}".encode()
    found: set[int] = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if marker in Path(entry.path, "environ").read_bytes().split(b"\0"):
                found.add(int(entry.name))
    for pid in list(found):
        with contextlib.suppress(OSError, ValueError):
            parent, _ = _parent_and_name(pid)
            while parent > 1 and _parent_and_name(parent)[1] == "bwrap":
                found.add(parent)
                parent = _parent_and_name(parent)[0]
    return sorted(found)

