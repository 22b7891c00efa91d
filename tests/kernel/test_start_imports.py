"""The kernel process starts without the modules its first cell does not need (issue 33:
their import was most of the start's CPU and several MiB of the process's memory).

`python -m sandbox_kernel.kernel --help` makes every import a start makes (the early start
finds no connection file and does nothing; ipykernel prints its help), which -X importtime
lists.
"""
from __future__ import annotations

import os
import subprocess
import sys

from sandbox_kernel.local.service import EngineEndpoint

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


def test_the_kernels_requests_to_its_local_engine_go_without_httpx_own_transport(engine: EngineEndpoint) -> None:
    """The kernel finds its local engine and sends it every request over connections of its
    own (api/kept_connections.py): httpx's transport is httpcore, with h11 and, under
    asyncio, anyio, whose imports took ~50 ms of the start's CPU from ipykernel's own. A
    process makes the client as the kernel does, sends a request and closes it, then says
    which of them it imported."""
    script = "\n".join((
        "import asyncio, sys",
        "from sandbox_kernel.config import Settings, open_client",
        "async def main():",
        "    async with await open_client(Settings.from_env()) as client:",
        "        await client.list_sandboxes()",
        "asyncio.run(main())",
        "print([name for name in sys.modules if name.partition('.')[0] in ('httpcore', 'h11', 'anyio')])"))
    env = {name: value for name, value in os.environ.items() if not name.startswith("CREATEOS_")}  # the local engine
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env=env, check=True)
    assert done.stdout.strip() == "[]"
