"""The engine's side of the agent protocol (see agent.py for the wire format)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import socket
import stat
from collections.abc import AsyncIterator
from pathlib import Path

CHUNK = 64 * 1024
# The agent reads a request line of at most this (agent.py's MAX_HEADER): a longer one is
# refused here, before anything is sent.
MAX_REQUEST = 1 << 20
# Longest line accepted from the agent. Its exec frames carry at most 64 KiB of text,
# which JSON escaping can grow sixfold (a control byte becomes \u0001): about 400 KiB.
MAX_REPLY_LINE = 1 << 20
# The longest line of a process's connect stream: a data frame carries at most 256 KiB of
# output (guest/processes.py READ_CHUNK), about 350 KiB in base64. It also sizes the stream's
# buffer: asyncio reads on until twice the limit is buffered, and each read that finds a
# buffer full copies it whole to grow it: at 1 MiB, StreamReader.feed_data was 24 % of the
# engine's samples while 20 MiB passed through (py-spy), at this 11 %.
MAX_CONNECT_LINE = 384 * 1024
# The longest answer line of a managed-process op: a list of 32 processes whose command
# lines may each take up to 64 KiB (guest/processes.py MAX_COMMAND_LINE).
MAX_PROCESS_REPLY = 4 << 20
MAX_SHARE_ANSWER = 4096  # {"ok": true, "input_seq": N}, or a refusal
# Idle connections kept per sandbox for managed-process calls. A cell's request is one
# `input` call: on a kept connection it skips the connect, the agent's accept and a task
# on each side. From the engine's route to the agent's handler took 1.9 ms with a new
# connection, 0.9 on a kept one (timestamps at each hop, median of 30 cells). A call that
# blocks (a `wait`, an `input` to a full pipe) holds its connection; the next opens another.
KEPT_CALL_CONNECTIONS = 2
SHARE_TIMEOUT = 10.0  # seconds an agent has to answer a stdin share (it runs: the engine checked)


class AgentError(Exception):
    """The agent refused or failed a file operation; `code` is not_found, invalid or failed."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class AgentUnavailable(Exception):
    """The agent's socket does not answer (the sandbox is gone or not started yet)."""


class RequestTooLarge(Exception):
    """A request the agent would refuse for its size (its line limit, MAX_REQUEST)."""


Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class AgentConnections:
    """One sandbox's connections to its agent, shared by all its AgentClients: every open
    one, so that an engine that stops can end them (Engine.close), and the idle ones kept
    for managed-process calls."""

    def __init__(self) -> None:
        self.open: set[asyncio.StreamWriter] = set()
        self.idle_for_calls: list[Connection] = []

    def close_idle(self) -> None:
        for _, writer in self.idle_for_calls:
            self.open.discard(writer)
            writer.close()
        self.idle_for_calls.clear()

    def close_all(self) -> None:
        self.idle_for_calls.clear()
        for writer in list(self.open):
            writer.close()


class AgentClient:
    def __init__(self, socket_dir: Path, connections: AgentConnections | None = None) -> None:
        self.socket_dir = socket_dir
        self.connections = connections if connections is not None else AgentConnections()

    async def _open(self, limit: int) -> Connection:
        # Connect through /proc/self/fd so a deep state dir cannot push the socket path
        # past the 108-byte sun_path limit. The dir is gone once its sandbox is destroyed
        # (a call racing the destroy): that agent is unavailable too.
        dir_fd = -1
        try:
            dir_fd = os.open(self.socket_dir, os.O_PATH)
            reader, writer = await asyncio.open_unix_connection(
                f"/proc/self/fd/{dir_fd}/agent.sock", limit=limit)
        except OSError as exc:
            raise AgentUnavailable(str(exc)) from None
        finally:
            if dir_fd >= 0:
                os.close(dir_fd)
        self.connections.open.add(writer)
        return reader, writer

    async def _close(self, writer: asyncio.StreamWriter) -> None:
        self.connections.open.discard(writer)
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()

    @contextlib.asynccontextmanager
    async def _connect(self, limit: int) -> AsyncIterator[Connection]:
        reader, writer = await self._open(limit)
        try:
            yield reader, writer
        finally:
            await self._close(writer)

    @contextlib.asynccontextmanager
    async def connection(self, request: dict, body: bytes = b"", limit: int = MAX_REPLY_LINE
                         ) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
        """A connection on which `request` (and `body`, raw after its line) has been sent;
        `limit` bounds each line of the answer."""
        line = encoded(request)
        async with self._connect(limit) as (reader, writer):
            await self._send(writer, line + body)
            yield reader, writer

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, data: bytes) -> None:
        try:
            writer.write(data)
            await writer.drain()
        except ConnectionError as exc:  # the agent ended just now (its sandbox is being destroyed)
            raise AgentUnavailable(str(exc)) from None

    @staticmethod
    async def _line(reader: asyncio.StreamReader) -> bytes:
        """One line from the agent; a longer one than MAX_REPLY_LINE breaks the connection."""
        try:
            return await reader.readline()
        except ValueError:  # asyncio's limit overrun: never buffered whole
            raise AgentUnavailable("agent sent a line longer than this connection's limit") from None
        except ConnectionError as exc:
            raise AgentUnavailable(str(exc)) from None

    @classmethod
    async def _reply(cls, reader: asyncio.StreamReader) -> dict:
        return _answer(await cls._line(reader))

    async def ping(self) -> dict:
        async with self.connection({"op": "ping"}) as (reader, _):
            return await self._reply(reader)

    async def fork(self, hostname: str, disk_mib: int, env: dict[str, str], listener: socket.socket) -> dict:
        """Make a new sandbox from this one, whose agent serves `listener` (the engine bound
        it): {"pid": its agent, "followers": [runner, ...]} (pids as seen inside the
        sandboxes' shared pid namespace). The listener follows the request once the agent
        says it reads it (as ancillary data, which a plain read would drop)."""
        request = {"op": "fork", "hostname": hostname, "disk_mib": disk_mib, "env": env}
        async with self.connection(request) as (reader, writer):
            await self._reply(reader)  # {"ok": true}: ready for the listener
            with socket.socket(fileno=os.dup(writer.get_extra_info("socket").fileno())) as raw:
                socket.send_fds(raw, [b"L"], [listener.fileno()])  # one byte: the buffer is empty
            return await self._reply(reader)

    async def exec(self, cmd: str, args: list[str], env: dict[str, str],
                   stdin: str = "") -> AsyncIterator[dict]:
        """Yield the command's CreateOS exec frames; closing the generator kills the command."""
        data = stdin.encode()
        async with self.connection(exec_request(cmd, args, env, len(data)), data) as (reader, _):
            while True:
                line = await self._line(reader)
                if not line:
                    return
                yield json.loads(line)

    async def process_call(self, op: str, body: bytes = b"", **fields: object) -> dict:
        """One managed-process op (create, list, get, kill, wait, input, stdin_close, resize,
        signal): the agent's answer, or AgentError (code not_found, invalid or conflict).
        `body` (input's data) follows the request line raw, its size in the line."""
        line = encoded({"op": "process_" + op, **fields, **({"size": len(body)} if body else {})})
        reader, writer = await self._call_connection()
        whole_answer = False
        try:  # a kept connection whose agent has gone fails in _send or _line
            await self._send(writer, line + body)
            answer = await self._line(reader)
            whole_answer = answer.endswith(b"\n")
            return _answer(answer)
        finally:
            await self._release_call_connection(reader, writer, reusable=whole_answer)

    async def _call_connection(self) -> Connection:
        """An idle kept connection, or a new one the agent serves calls on (op process_calls)."""
        idle = self.connections.idle_for_calls
        while idle:
            reader, writer = idle.pop()
            if not reader.at_eof() and not writer.is_closing():
                writer.transport.resume_reading()
                return reader, writer
            await self._close(writer)  # the agent closed it meanwhile (its sandbox ended)
        reader, writer = await self._open(MAX_PROCESS_REPLY)
        writer.write(encoded({"op": "process_calls"}))
        return reader, writer

    async def _release_call_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                                       reusable: bool) -> None:
        """Keep it for the next call only once its answer was read whole (after a failed or
        cancelled call, an answer may still be on its way). An idle one is not read: what an
        agent writes unasked waits in the socket, not in the engine's memory."""
        if reusable and len(self.connections.idle_for_calls) < KEPT_CALL_CONNECTIONS:
            writer.transport.pause_reading()
            self.connections.idle_for_calls.append((reader, writer))
        else:
            await self._close(writer)

    async def share_stdin(self, process_id: str) -> tuple[int, int, Connection]:
        """The write end of a pipe process's stdin, shared by the agent so that the engine
        writes input itself (agent.py, process_stdin_share): the descriptor, the process's
        input_seq so far, and the share's connection, on which the engine reports the
        input_seq as it goes on and whose end (either side hangs up) ends the share.
        AgentError if the agent refuses; a descriptor that is not a pipe's write end (the
        sandbox may send anything) is refused here."""
        reader, writer = await self._open(MAX_REPLY_LINE)
        writer.transport.pause_reading()  # the answer carries the descriptor: received below
        try:
            await self._send(writer, encoded({"op": "process_stdin_share", "id": process_id}))
            answer, fds = await _receive_with_descriptors(writer.get_extra_info("socket").fileno())
            try:
                input_seq = _share_answer(answer)
                fd = _pipe_write_end(fds)
            except BaseException:
                for received in fds:
                    os.close(received)
                raise
        except BaseException:
            await self._close(writer)
            raise
        writer.transport.resume_reading()
        return fd, input_seq, (reader, writer)

    def hang_up(self, writer: asyncio.StreamWriter) -> None:
        """End a connection of this sandbox's without waiting for it to close."""
        self.connections.open.discard(writer)
        writer.close()

    @contextlib.asynccontextmanager
    async def process_connect(self, process_id: str, after: int) -> AsyncIterator[AsyncIterator[bytes]]:
        """The process's connect frames, one JSON line each, as the agent sends them; AgentError
        before any frame if there is no such process. Leaving the block disconnects."""
        request = {"op": "process_connect", "id": process_id, "after": after}
        async with self.connection(request, limit=MAX_CONNECT_LINE) as (reader, _):
            await self._reply(reader)
            yield self._lines(reader)

    async def _lines(self, reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
        while line := await self._line(reader):
            yield line

    async def write_file(self, path: str, chunks: AsyncIterator[bytes], size: int | None) -> int:
        """Stream an upload into the sandbox (never held whole): the bytes, then EOF. With
        `size` (when the client announced it) the agent refuses an upload cut short.

        The agent answers as soon as it fails (a full disk, say): the rest of the upload
        is then not sent (the agent discards what was already on the way)."""
        request = {"op": "write", "path": path, **({} if size is None else {"size": size})}
        async with self.connection(request) as (reader, writer):
            reply = asyncio.ensure_future(self._reply(reader))
            sending = asyncio.ensure_future(_send_all(chunks, writer))
            try:
                await asyncio.wait([reply, sending], return_when=asyncio.FIRST_COMPLETED)
                if not reply.done():
                    with contextlib.suppress(ConnectionError):
                        await sending  # re-raises a failure of the upload's own source
                return (await reply)["bytes"]
            finally:
                for task in (sending, reply):
                    task.cancel()
                await asyncio.gather(sending, reply, return_exceptions=True)

    @contextlib.asynccontextmanager
    async def read_file(self, path: str) -> AsyncIterator[tuple[int, AsyncIterator[bytes]]]:
        """(size, chunks) of a file in the sandbox, streamed while the context is open."""
        async with self.connection({"op": "read", "path": path}) as (reader, _):
            size = (await self._reply(reader))["size"]

            async def chunks() -> AsyncIterator[bytes]:
                remaining = size
                while remaining:
                    chunk = await reader.read(min(CHUNK, remaining))
                    if not chunk:
                        raise AgentError("failed", f"{path}: file changed while being read")
                    remaining -= len(chunk)
                    yield chunk

            yield size, chunks()


def _answer(line: bytes) -> dict:
    """The agent's answer line, or AgentError when it says the op failed."""
    if not line:
        raise AgentUnavailable("agent closed the connection")
    reply = json.loads(line)
    if reply.get("ok") is False:
        raise AgentError(reply.get("code", "failed"), reply.get("error", "agent error"))
    return reply


async def _receive_with_descriptors(fd: int) -> tuple[bytes, list[int]]:
    """One message from the socket `fd` (whose transport has paused reading), with the one
    descriptor (close-on-exec) that came with it, if one did: more than one is refused."""
    loop = asyncio.get_running_loop()
    with socket.socket(fileno=os.dup(fd)) as connection:
        readable = loop.create_future()
        loop.add_reader(connection.fileno(), lambda: readable.done() or readable.set_result(None))
        try:
            await asyncio.wait_for(readable, SHARE_TIMEOUT)
        except asyncio.TimeoutError:
            raise AgentUnavailable("the agent did not answer a stdin share") from None
        finally:
            loop.remove_reader(connection.fileno())
        try:
            answer, fds, flags, _ = socket.recv_fds(connection, MAX_SHARE_ANSWER, 1, socket.MSG_CMSG_CLOEXEC)
        except OSError as exc:
            raise AgentUnavailable(str(exc)) from None
    if flags & socket.MSG_CTRUNC:  # more descriptors came (the kernel closed the rest)
        for received in fds:
            os.close(received)
        raise AgentError("invalid", "the agent's stdin share came with more than one descriptor")
    return answer, fds


def _share_answer(answer: bytes) -> int:
    """The input_seq a stdin share's answer gives; AgentError if the agent refused or sent
    something else."""
    try:
        input_seq = _answer(answer).get("input_seq")
    except (ValueError, AttributeError):
        input_seq = None
    if not answer.endswith(b"\n") or type(input_seq) is not int or input_seq < 0:
        raise AgentError("invalid", "the agent's answer to a stdin share is not one")
    return input_seq


def _pipe_write_end(fds: list[int]) -> int:
    """The one descriptor received, if it is the write end of a pipe (made non-blocking)."""
    if len(fds) != 1 or not stat.S_ISFIFO(os.fstat(fds[0]).st_mode) \
            or fcntl.fcntl(fds[0], fcntl.F_GETFL) & os.O_ACCMODE != os.O_WRONLY:
        raise AgentError("invalid", "the agent's stdin share is not a pipe's write end")
    os.set_blocking(fds[0], False)
    return fds[0]


def exec_request(cmd: str, args: list[str], env: dict[str, str], stdin_size: int = 0) -> dict:
    """An exec's request line; its `stdin_size` bytes of standard input follow it raw."""
    return {"op": "exec", "cmd": cmd, "args": args, "env": env, "stdin_size": stdin_size}


def encoded(request: dict) -> bytes:
    """The request line; RequestTooLarge if the agent would refuse it for its size."""
    line = json.dumps(request).encode() + b"\n"
    if len(line) > MAX_REQUEST:
        raise RequestTooLarge(f"the request is {len(line)} bytes encoded; the sandbox agent "
                              f"takes at most {MAX_REQUEST}")
    return line


async def _send_all(chunks: AsyncIterator[bytes], writer: asyncio.StreamWriter) -> None:
    async for chunk in chunks:
        writer.write(chunk)
        await writer.drain()
    writer.write_eof()
