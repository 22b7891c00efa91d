"""The benchmark entry point runs end to end (tiny repeat counts), so bench/ cannot rot.

It asserts that every measure produced its row, never a time: the numbers of a --quick run
on a busy CI machine mean nothing.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "run.py"
ROWS = ("trivial cell round trip", "streaming: first chunk", "streaming: lag", "streaming: throughput",
        "a background thread's print",
        "matplotlib PNG", "DataFrame HTML", "start to first result, cold", "start to first result, warm",
        "pause of a runner", "resume of a runner", "fork of a runner", "10 forks of one source", "density:", "memory per idle sandbox",
        "memory of the sandbox kernel", "cloud, 30 ms round trip: trivial cell", "cloud, 30 ms round trip: a cold kernel start")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_every_measure_runs_and_reports_a_row(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(BENCH), "--quick"], capture_output=True, text=True,
                          timeout=230, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    table = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| Measure |")
    for row in ROWS:
        assert sum(row in line for line in table) == 1, (row, done.stdout)
