"""How the runner ended, from its warden's record (sandbox/runner_setup.py): the record lies
in the sandbox, whose code can rewrite it, so only a status and a peak of sane size are taken;
and the warden itself records what a shell could not (a real run of guest/runner/warden.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sandbox_kernel.guest.runner import warden as runner_warden
from sandbox_kernel.sandbox.runner_setup import RunnerEnd, parse_runner_end


@pytest.mark.parametrize(("record", "end", "cause"), [
    ("137 262144\n", RunnerEnd(137, 256), "killed by SIGKILL"),
    ("3 30720\n", RunnerEnd(3, 30), "exit code 3"),
    ("0\n", RunnerEnd(0, None), "exit code 0"),  # an older runner's shell wrote only its status
])
def test_a_record_says_the_status_and_the_peak(record: str, end: RunnerEnd, cause: str) -> None:
    assert parse_runner_end(record) == end
    assert end.cause() == cause


@pytest.mark.parametrize("record", ["", "abc", "-9 100", "1 2 3", "256 1", "1 9999999999999", "1 1e9", "٣ 1"])
def test_a_record_that_is_no_runners_end_is_refused(record: str) -> None:
    with pytest.raises(ValueError):
        parse_runner_end(record)


def test_the_warden_records_a_killed_pythons_status_and_peak(tmp_path: Path) -> None:
    script = tmp_path / "hog.py"
    script.write_text("import os, signal\nheld = b'x' * (64 << 20)\nos.kill(os.getpid(), signal.SIGKILL)\n")
    record = tmp_path / "record"
    subprocess.run([sys.executable, "-I", "-S", runner_warden.__file__, str(record), str(script)], check=True)
    end = parse_runner_end(record.read_text())
    assert end.cause() == "killed by SIGKILL"
    assert end.peak_mib is not None and 64 <= end.peak_mib < 256
