"""The agent runs in every local sandbox for its whole life, so what it imports is memory paid
once per sandbox: it must not load OpenSSL (ssl, which asyncio imports where it can, and
_hashlib, which secrets and hashlib bring), which it has no use for (~2 MiB PSS), nor at start
what only a rare request needs (urllib.parse, for a self-signal: ~0.45 MiB)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import sandbox_kernel.guest.agent

RUN_AGENT = Path(sandbox_kernel.guest.agent.__file__).parent / "run_agent.py"
NOT_AT_START = ("ssl", "_ssl", "_hashlib", "urllib.parse")

# run_agent.py as bwrap starts it, with no arguments: the agent module is imported and its
# main() refuses to serve (usage, exit status 2); then the modules loaded are listed.
PROBE = """
import runpy, sys
sys.argv = [{path!r}]
try:
    runpy.run_path({path!r}, run_name="__main__")
except SystemExit as exit:
    status = exit.code
agent = [name for name in sys.modules if name.endswith(".agent.agent")]
loaded = [name for name in {modules!r} if sys.modules.get(name) is not None]
print(status, " ".join(agent), ",".join(loaded) or "-")
"""


def test_the_agent_starts_without_openssl_or_what_a_rare_request_needs() -> None:
    probe = PROBE.format(path=str(RUN_AGENT), modules=NOT_AT_START)
    result = subprocess.run([sys.executable, "-I", "-S", "-c", probe], capture_output=True, text=True,
                            timeout=60)
    assert "usage: run_agent.py" in result.stderr, result.stderr
    status, agent_module, loaded = result.stdout.split()
    assert (status, agent_module) == ("2", "guest.agent.agent")
    assert loaded == "-", f"the agent loaded {loaded}"
