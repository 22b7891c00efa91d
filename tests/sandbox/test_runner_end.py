"""How the runner ended, from its warden's record (sandbox/runner_setup.py): the record lies
in the sandbox, whose code can rewrite it, so only a status and a peak of sane size are taken;
and the warden records what a shell alone could not, the peak, and survives a SIGINT meant for
the cell's processes (real runs of runner_setup.watched's script and guest/runner/warden.py)."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox_kernel.guest.runner import warden as runner_warden
from sandbox_kernel.sandbox.runner_setup import RunnerEnd, parse_runner_end, watched


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


def watched_to_its_end(tmp_path: Path, daemon_code: str, shell: str = "sh") -> RunnerEnd:
    """Run `daemon_code` as the kernel runs the daemon (runner_setup.watched: a shell that
    becomes guest/runner/warden.py), in a session of its own; its warden's record."""
    daemon = tmp_path / "daemon.py"
    daemon.write_text(daemon_code)
    record = tmp_path / "record"
    script = watched(f"{shlex.quote(sys.executable)} {shlex.quote(str(daemon))}", shlex.quote(str(record)),
                     warden=shlex.quote(runner_warden.__file__), python=shlex.quote(sys.executable))
    subprocess.run([shell, "-c", script], check=True, start_new_session=True, timeout=60)
    return parse_runner_end(record.read_text())


def test_the_warden_records_a_killed_pythons_status_and_peak(tmp_path: Path) -> None:
    end = watched_to_its_end(tmp_path, "import os, signal\nheld = b'x' * (64 << 20)\n"
                                       "os.kill(os.getpid(), signal.SIGKILL)\n")
    assert end.cause() == "killed by SIGKILL"
    assert end.peak_mib is not None and 64 <= end.peak_mib < 256


# The daemon ignores SIGINT between cells, and a cell may send it to its whole process group,
# the warden's too. (Run from pytest, the shell does not start with SIGINT ignored, as it does
# in a sandbox, started in the background: here the script's own line is what protects it.)
SIGINT_TO_THE_GROUP = """
import os, signal, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
os.killpg(0, signal.SIGINT)
time.sleep(0.2)
os._exit(3)
"""


@pytest.mark.parametrize("shell", ["sh", "bash"])
def test_a_sigint_to_the_process_group_ends_the_daemon_before_its_warden(tmp_path: Path, shell: str) -> None:
    if shutil.which(shell) is None:
        pytest.skip(f"no {shell} here")
    end = watched_to_its_end(tmp_path, SIGINT_TO_THE_GROUP, shell)
    assert end.cause() == "exit code 3" and end.peak_mib is not None
