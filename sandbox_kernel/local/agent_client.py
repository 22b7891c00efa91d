"""The engine's side of the agent protocol (see agent.py for the wire format)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

CHUNK = 64 * 1024
# The longest answer line of a managed-process op: a list of 32 processes whose command
# lines may each take up to 64 KiB (guest/processes.py MAX_COMMAND_LINE).
MAX_PROCESS_REPLY = 4 << 20


class AgentError(Exception):
    """The agent refused or failed a file operation; `code` is not_found, invalid or failed."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class AgentUnavailable(Exception):
    """The agent's socket does not answer (the sandbox is gone or not started yet)."""


async def lines(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    while line := await reader.readline():
        yield line


class AgentClient:
    def __init__(self, socket_dir: Path) -> None:
        self.socket_dir = socket_dir

    @contextlib.asynccontextmanager
    async def _connect(self, limit: int = 4 * CHUNK
                       ) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
        # Connect through /proc/self/fd so a deep state dir cannot push the socket path
        # past the 108-byte sun_path limit.
        dir_fd = os.open(self.socket_dir, os.O_PATH)
        try:
            reader, writer = await asyncio.open_unix_connection(
                f"/proc/self/fd/{dir_fd}/agent.sock", limit=limit)
        except OSError as exc:
            raise AgentUnavailable(str(exc)) from None
        finally:
            os.close(dir_fd)
        try:
            yield reader, writer
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    @contextlib.asynccontextmanager
    async def connection(self, request: dict, body: bytes = b"", limit: int = 4 * CHUNK
                         ) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
        """A connection on which `request` (and `body`) has been sent; `limit` bounds an
        answer's line."""
        async with self._connect(limit) as (reader, writer):
            writer.write(json.dumps(request).encode() + b"\n" + body)
            await writer.drain()
            yield reader, writer

    @staticmethod
    async def _reply(reader: asyncio.StreamReader) -> dict:
        line = await reader.readline()
        if not line:
            raise AgentUnavailable("agent closed the connection")
        reply = json.loads(line)
        if reply.get("ok") is False:
            raise AgentError(reply.get("code", "failed"), reply.get("error", "agent error"))
        return reply

    async def ping(self) -> dict:
        async with self.connection({"op": "ping"}) as (reader, _):
            return await self._reply(reader)

    async def fork(self, hostname: str, disk_mib: int, env: dict[str, str]) -> dict:
        """Make a new sandbox from this one: {"pid": its agent, "followers": [runner, ...]}
        (pids as seen inside the sandboxes' shared pid namespace)."""
        request = {"op": "fork", "hostname": hostname, "disk_mib": disk_mib, "env": env}
        async with self.connection(request) as (reader, _):
            return await self._reply(reader)

    async def exec(self, cmd: str, args: list[str], env: dict[str, str],
                   stdin: str = "") -> AsyncIterator[dict]:
        """Yield the command's CreateOS exec frames; closing the generator kills the command."""
        data = stdin.encode()
        request = {"op": "exec", "cmd": cmd, "args": args, "env": env, "stdin_size": len(data)}
        async with self.connection(request, data) as (reader, _):
            while True:
                line = await reader.readline()
                if not line:
                    return
                yield json.loads(line)

    async def process_call(self, op: str, body: bytes = b"", **fields: object) -> dict:
        """One managed-process op (create, list, get, kill, wait, input, stdin_close, resize,
        signal): the agent's answer, or AgentError (code not_found, invalid or conflict).
        `body` (input's data) follows the request line raw, its size in the line."""
        request = {"op": "process_" + op, **fields, **({"size": len(body)} if body else {})}
        async with self.connection(request, body, limit=MAX_PROCESS_REPLY) as (reader, _):
            return await self._reply(reader)

    @contextlib.asynccontextmanager
    async def process_connect(self, process_id: str, after: int) -> AsyncIterator[AsyncIterator[bytes]]:
        """The process's connect frames, one JSON line each, as the agent sends them; AgentError
        before any frame if there is no such process. Leaving the block disconnects."""
        async with self.connection({"op": "process_connect", "id": process_id, "after": after}) as (reader, _):
            await self._reply(reader)
            yield lines(reader)

    async def write_file(self, path: str, data: bytes) -> int:
        async with self.connection({"op": "write", "path": path, "size": len(data)}, data) as (reader, _):
            return (await self._reply(reader))["bytes"]

    async def read_file(self, path: str) -> bytes:
        async with self.connection({"op": "read", "path": path}) as (reader, _):
            size = (await self._reply(reader))["size"]
            try:
                return await reader.readexactly(size)
            except asyncio.IncompleteReadError:
                raise AgentError("failed", f"{path}: file changed while being read") from None
