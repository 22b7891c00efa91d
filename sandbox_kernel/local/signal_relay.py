"""The engine's end of a sandbox's self-signals (§9; the sandbox's end is guest/self_signal.py).

The engine holds one `signal_listen` connection open to each running sandbox's agent and
reads {"signal": "pause"|"delete", "reason": str} lines from it. The connection belongs
to one sandbox, so whatever arrives on it can only pause or delete that sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable

from sandbox_kernel.local.agent_client import AgentClient, AgentUnavailable

log = logging.getLogger("sandbox_kernel.signals")

RECONNECT_DELAY = 0.5
ACTIONS = ("pause", "delete")
MAX_REASON = 128  # characters: CreateOS truncates the reason there


class SignalRelay:
    def __init__(self, agent: Callable[[], AgentClient],
                 act: Callable[[str, str], Awaitable[None]]) -> None:
        self.agent = agent
        self.act = act  # act(action, reason) on this relay's sandbox
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._listen())

    async def stop(self) -> None:
        if self.task and self.task is not asyncio.current_task():
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

    async def _listen(self) -> None:
        while True:
            try:
                async with self.agent().connection({"op": "signal_listen"}) as (reader, _):
                    await reader.readline()  # {"ok": true}
                    while line := await reader.readline():
                        message = json.loads(line)
                        action = message.get("signal")
                        if action in ACTIONS:
                            await self.act(action, str(message.get("reason", ""))[:MAX_REASON])
            except (AgentUnavailable, ConnectionError, ValueError, AttributeError) as exc:
                log.debug("signal channel: %s", exc)
            await asyncio.sleep(RECONNECT_DELAY)
