"""The agent's table of managed processes (guest/agent/processes.py) without an agent: how a
wait learns of a change."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

from sandbox_kernel.guest.agent.processes import ManagedProcess, ProcessTable


async def test_a_change_just_as_a_wait_begins_ends_the_wait(tmp_path: Path) -> None:
    """The change is made by a callback queued before the wait's own first step. On Python
    3.11, asyncio.wait_for starts its awaitable as a task, one step later: a wait that took
    the change's future in that step took the next one, and slept until its timeout (a
    process that had exited answered wait_process only after timeout_ms: 20 s in a test)."""
    popen = subprocess.Popen(["true"])
    popen.wait()
    process = ManagedProcess("process", "true", [], str(tmp_path), popen, {}, None, None)

    def tree_exits() -> None:
        process.leader_exited = process.tree_exited = True
        process.notify()

    table = ProcessTable(str(tmp_path))
    asyncio.get_running_loop().call_soon(tree_exits)
    async with asyncio.timeout(60):  # awaited in this task: the wait's first look comes first
        waited = await table.wait(process, "tree", timeout_ms=600_000)
    assert waited.tree_exited
