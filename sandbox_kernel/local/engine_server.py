"""uvicorn, taught to end the engine's running commands before it waits for open requests."""

from __future__ import annotations

import socket

import uvicorn

from sandbox_kernel.local.engine import Engine


class EngineServer(uvicorn.Server):
    """On SIGTERM/SIGINT uvicorn would wait (up to its grace period) for open requests,
    then cut them mid-body. Engine.close first ends every command running in an exec the
    way CreateOS ends an exec it cannot finish (a buffered exec gets a JSend error, a
    stream an error frame and an exit code), so the requests finish by themselves and
    nothing is torn; the sandboxes themselves, and their managed processes, run on for the
    next engine to take over."""

    def __init__(self, engine: Engine, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.engine = engine

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for listener in self.servers:
            listener.close()  # no new connections while the commands end
        await self.engine.close()
        await super().shutdown(sockets=sockets)
