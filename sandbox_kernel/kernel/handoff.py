"""The restart hand-off: a restarting kernel leaves its sandbox to the next kernel process.

jupyter_client restarts a kernel by starting a new process on the same connection file. The
old one writes a private file beside it (paths.handoff_path): the sandbox it drove, its
shutdown policy and the sandboxes it owns; the new one takes (and deletes) the file at boot
and starts a fresh runner in that sandbox, so a restart keeps the files and loses the
Python state, as a restart of a local kernel does. After a runner's death the old process
hands off the same way (kernel/shutdown.py: die_with_the_runner).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from sandbox_kernel.paths import handoff_path, write_private
from sandbox_kernel.sandbox.session import RESTART_HANDOFF_WAIT, SandboxSession

HANDOFF_MAX_AGE = RESTART_HANDOFF_WAIT  # a restart hand-off older than this is stale


class RestartHandoff:
    """The hand-off file of one kernel's connection file (none without a connection file)."""

    def __init__(self, connection_file: str | None) -> None:
        self.path: Path | None = handoff_path(connection_file) if connection_file else None

    async def hand_off(self, session: SandboxSession, fresh_runner: bool = True) -> None:
        """Close the session for a restart and leave its sandboxes to the next kernel.

        fresh_runner=False (the runner died): the next kernel keeps a runner it finds
        serving, and starts one only if none does. Another notebook attached to the sandbox
        may have started one there (`%sandbox attach --restart-runner`, ending ours): a
        fresh one would end that in turn, and the two kernels would restart each other."""
        owned = await session.close_for_restart()
        if session.sandbox_id:
            self.write(session.sandbox_id, session.on_shutdown, owned, fresh_runner)

    def write(self, sandbox_id: str, on_shutdown: str, owned: list[str], fresh_runner: bool = True) -> None:
        if self.path is not None:
            self.path.parent.mkdir(mode=0o700, exist_ok=True)
            write_private(self.path, json.dumps({"sandbox_id": sandbox_id, "on_shutdown": on_shutdown,
                                                 "owned": owned, "fresh_runner": fresh_runner,
                                                 "time": time.time()}))

    def take(self) -> dict[str, Any] | None:
        """What the previous kernel handed off (the file is gone after), or None: no file, or
        one too old to trust."""
        if self.path is None or not self.path.exists():
            return None
        try:
            info = json.loads(self.path.read_text())
        finally:
            self.path.unlink(missing_ok=True)
        if time.time() - info.get("time", 0) > HANDOFF_MAX_AGE or "sandbox_id" not in info:
            return None
        return info
