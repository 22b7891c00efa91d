"""The `sandbox-kernel` command as a user runs it, for tests of the command line."""
from __future__ import annotations

import os
import subprocess
import sys


def cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    """`python -m sandbox_kernel ARGS` with env added to this process's environment."""
    return subprocess.run([sys.executable, "-m", "sandbox_kernel", *args], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)
