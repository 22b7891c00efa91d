"""The README's first test command's end-to-end set names tests that exist: a renamed test
would otherwise drop out of it unnoticed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from quick_set import QUICK


def test_every_quick_test_is_collected() -> None:
    root = Path(__file__).resolve().parents[2]
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "quick",
                             "-p", "no:cacheprovider"], cwd=root, capture_output=True, text=True, check=True)
    collected = {line for line in listed.stdout.splitlines() if "::" in line}
    assert collected == set(QUICK)
