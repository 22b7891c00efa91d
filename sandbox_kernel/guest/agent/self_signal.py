"""The in-sandbox self-signal endpoint (createos-api.md §9), served by the agent.

A process in the sandbox asks for its own sandbox to be paused or deleted:
    POST http://127.0.0.1:1029/self/pause[?reason=...]
    POST http://127.0.0.1:1029/self/delete[?reason=...]
and gets 202 once the engine has the request. The agent passes it on as one JSON line
{"signal": "pause"|"delete", "reason": str} on the `signal_listen` connection the engine
holds open to this sandbox's agent; the engine acts on the sandbox that connection
belongs to, so a sandbox can only ever signal itself. Stdlib only: it runs on the
sandbox's Python.
"""

from __future__ import annotations

import asyncio
import json

PORT = 1029
ACTIONS = ("pause", "delete")
MAX_REASON = 128  # characters, as CreateOS truncates it
MAX_REQUEST_HEAD = 16 * 1024
READ_TIMEOUT = 10.0


class SelfSignals:
    def __init__(self) -> None:
        self.engine: asyncio.StreamWriter | None = None  # the engine's signal_listen connection

    async def engine_listens(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Hold the engine's connection until it goes away; signals are written to it."""
        self.engine = writer
        writer.write(b'{"ok":true}\n')
        await writer.drain()
        await reader.read()
        if self.engine is writer:
            self.engine = None

    async def client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One HTTP request from a process in the sandbox."""
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT)
            status, message = await self.answer(head.decode("latin-1").split("\r\n", 1)[0])
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError,
                ConnectionError, ValueError):
            status, message = 400, "bad request"
        body = json.dumps({"status": "success" if status == 202 else "fail",
                           "data": {"message": message}}).encode()
        reason_phrase = {202: "Accepted", 400: "Bad Request", 404: "Not Found",
                         405: "Method Not Allowed", 503: "Service Unavailable"}[status]
        try:
            writer.write(b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                         b"Connection: close\r\n\r\n%s" % (status, reason_phrase.encode(), len(body), body))
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def answer(self, request_line: str) -> tuple[int, str]:
        # Imported on the first self-signal, which most sandboxes never send: urllib.parse
        # (with ipaddress) would hold ~0.45 MiB in every agent.
        from urllib.parse import parse_qs, urlsplit

        method, target, _version = request_line.split(" ", 2)
        url = urlsplit(target)
        action = url.path[len("/self/"):] if url.path.startswith("/self/") else ""
        if action not in ACTIONS:
            return 404, "not found: POST /self/pause or /self/delete"
        if method != "POST":
            return 405, "use POST"
        engine = self.engine
        if engine is None:
            return 503, "the engine is not listening for signals"
        reason = (parse_qs(url.query).get("reason") or [""])[0][:MAX_REASON]
        engine.write((json.dumps({"signal": action, "reason": reason}) + "\n").encode())
        await engine.drain()
        return 202, "%s requested" % action


async def serve(signals: SelfSignals) -> asyncio.AbstractServer:
    return await asyncio.start_server(signals.client, "127.0.0.1", PORT, limit=MAX_REQUEST_HEAD)
