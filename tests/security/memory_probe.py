"""How much a host process's memory grew during an attack: its peak RSS (VmHWM) over the
attack, against its RSS just before. The peak is reset first (writing 5 to clear_refs), so
it is the attack's own peak, however short, not one from an earlier test."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MIB = 1024 * 1024


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise LookupError(f"{field} not in /proc/{pid}/status")


@dataclass
class Growth:
    pid: int
    before_mib: float = 0.0
    peak_mib: float = 0.0

    @property
    def mib(self) -> float:
        return self.peak_mib - self.before_mib


@contextlib.contextmanager
def memory_growth(pid: int) -> Iterator[Growth]:
    growth = Growth(pid)
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # reset the peak to the RSS of now
    growth.before_mib = _status_kib(pid, "VmRSS") / 1024
    yield growth
    growth.peak_mib = _status_kib(pid, "VmHWM") / 1024
