"""The kernel process starts without the modules its first cell does not need (issue 33:
their import was most of the start's CPU and several MiB of the process's memory).

`python -m sandbox_kernel.kernel --help` makes every import a start makes (the early start
finds no connection file and does nothing; ipykernel prints its help), which -X importtime
lists.
"""
from __future__ import annotations

import subprocess
import sys

# Imported where first used: magics, transfers, sweeps, the shutdown policy, sealed
# notebooks, the input history, the runner's tar file, pip's configuration's parser.
DEFERRED = {
    "sandbox_kernel.kernel.magics.dispatch", "sandbox_kernel.sandbox.transfer", "sandbox_kernel.sandbox.sweep",
    "sandbox_kernel.sandbox.shutdown_policy", "sandbox_kernel.sandbox.sealed", "sandbox_kernel.kernel.history",
    "sqlite3", "tarfile", "configparser",
    # httpx's command-line client's dependencies (kernel/__main__.py keeps it out).
    "rich", "click",
}
# Never imported by the kernel's process: the wire models check JSON without pydantic
# (api/wire.py), which only the local engine's server uses.
NEVER = {"pydantic", "pydantic_core"}


def test_the_kernel_starts_without_what_its_first_cell_does_not_need() -> None:
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "sandbox_kernel.kernel", "--help"],
                          capture_output=True, text=True, timeout=120, check=True)
    imported = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines()
                if line.startswith("import time:") and line.count("|") == 2}
    assert "sandbox_kernel.kernel.handlers" in imported  # the listing is the kernel's
    assert not DEFERRED & imported
    assert not NEVER & imported
