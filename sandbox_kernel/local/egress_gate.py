"""The way out of one local sandbox: the agent's egress streams, handed to the proxy.

The engine keeps one `egress_listen` connection open to each running sandbox's agent.
When a process in the sandbox connects to the egress port on its loopback, the agent
announces a stream number there; the gate opens `egress_attach` for it and lets the
egress proxy (egress_proxy.py) serve that stream with the sandbox's current rules. The
rules are read at every connection, so a PUT applies to the next connection at once, and
`rules_changed` cuts the open tunnels the new rules deny. A sandbox may hold at most
MAX_STREAMS at once: each costs the engine descriptors, which every sandbox shares; the
agent closes a connection the engine does not take.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from ipaddress import IPv4Address, IPv6Address

from sandbox_kernel.api.egress_rules import Decision, decide, screen_name
from sandbox_kernel.api.local_engine import HOST_ALIAS
from sandbox_kernel.local.agent_client import AgentClient, AgentUnavailable
from sandbox_kernel.local.egress_proxy import EgressProxy, _default_resolve as resolve_by_dns

log = logging.getLogger("sandbox_kernel.egress")

RECONNECT_DELAY = 0.5
MAX_STREAMS = 128  # open egress connections per sandbox (each holds one or two engine descriptors)

HOST_LOOPBACK = [IPv4Address("127.0.0.1")]


async def resolve_on_host(host: str, port: int) -> list[IPv4Address | IPv6Address]:
    """What a requested name means on the host: HOST_ALIAS is its loopback, the rest DNS."""
    if host.lower().rstrip(".") == HOST_ALIAS:
        return list(HOST_LOOPBACK)
    return await resolve_by_dns(host, port)


class EgressGate:
    def __init__(self, agent: Callable[[], AgentClient], rules: Callable[[], list[str]],
                 blocked_ports: list[int]) -> None:
        self.agent = agent
        self.rules = rules
        self.proxy = EgressProxy(self._decide, screen=self._screen, resolve=resolve_on_host,
                                 blocked_ports=blocked_ports)
        self.refused_streams = 0  # connections not taken: MAX_STREAMS were open
        self.task: asyncio.Task[None] | None = None
        self.streams: set[asyncio.Task[None]] = set()  # the loop keeps only weak references

    def _decide(self, host: str | None, address: IPv4Address | IPv6Address, port: int) -> Decision:
        return decide(self.rules(), host, address, port)

    def _screen(self, host: str, port: int) -> Decision | None:
        return screen_name(self.rules(), host, port)

    def rules_changed(self) -> None:
        cut = self.proxy.cut_disallowed()
        if cut:
            log.info("cut %d egress connections the new rules deny", cut)

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._listen())

    async def stop(self) -> None:
        for task in (self.task, *self.streams):
            if task:
                task.cancel()
        for task in (self.task, *self.streams):
            if task:
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _listen(self) -> None:
        """Take announcements for as long as the sandbox lives (reconnect if it drops)."""
        while True:
            try:
                async with self.agent().connection({"op": "egress_listen"}) as (reader, _):
                    await reader.readline()  # {"ok": true}
                    while line := await reader.readline():
                        if len(self.streams) >= MAX_STREAMS:
                            self.refused_streams += 1  # not attached: the agent closes it
                            if self.refused_streams == 1:
                                log.warning("a sandbox holds %d egress connections: refusing more", MAX_STREAMS)
                            continue
                        task = asyncio.get_running_loop().create_task(self._serve(json.loads(line)["stream"]))
                        self.streams.add(task)
                        task.add_done_callback(self.streams.discard)
            except (AgentUnavailable, ConnectionError, ValueError, KeyError) as exc:
                log.debug("egress channel: %s", exc)
            await asyncio.sleep(RECONNECT_DELAY)

    async def _serve(self, stream: int) -> None:
        try:
            async with self.agent().connection({"op": "egress_attach", "stream": stream}) as (reader, writer):
                await self.proxy.handle(reader, writer)
        except (AgentUnavailable, ConnectionError) as exc:
            log.debug("egress stream %d: %s", stream, exc)
