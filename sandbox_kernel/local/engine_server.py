"""uvicorn, taught to end the engine's sandboxes before it waits for open requests."""

from __future__ import annotations

import socket

import uvicorn

from .engine import Engine


class EngineServer(uvicorn.Server):
    """On SIGTERM/SIGINT uvicorn would wait (up to its grace period) for open requests,
    then cut them mid-body. Destroying the sandboxes first ends every running command the
    way CreateOS ends it (a buffered exec gets a JSend error, a stream an error frame and
    an exit code), so the requests finish by themselves and nothing is torn."""

    def __init__(self, engine: Engine, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.engine = engine

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for listener in self.servers:
            listener.close()  # no new connections while the sandboxes go
        await self.engine.close()
        await super().shutdown(sockets=sockets)
