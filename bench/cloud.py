"""The cloud case: the same cells with a simulated round trip between kernel and engine.

The sandbox kernel reaches the bench's engine through a delay proxy on loopback, on the
CreateOS code path (base URL and API key, as for the cloud). The proxy holds every chunk,
each way, for half the round trip, and counts the HTTP requests that pass. Each measure
runs twice, with no delay and with the round trip, through the same proxy: the extra
time divided by the round trip is how many round trips the action waits for in sequence
(requests sent in parallel count once), which is what a user far from the service pays.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import AsyncIterator

from common import SANDBOX, BenchEnv, Row, kernel, ms, run_ok
from sandbox_kernel.config import ENV_VARS
from sandbox_kernel.local.service import read_endpoint

METHODS = (b"GET ", b"POST ", b"PUT ", b"DELETE ", b"PATCH ")


class DelayProxy:
    """A loopback TCP proxy that delivers each chunk `one_way` seconds after it arrived,
    in order, in both directions; `requests` counts request lines seen."""

    def __init__(self, upstream_port: int, one_way: float) -> None:
        self.upstream_port = upstream_port
        self.one_way = one_way
        self.requests = 0
        self.port = 0
        self._server: asyncio.AbstractServer | None = None

    async def __aenter__(self) -> DelayProxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        upstream_r, upstream_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        tasks = [asyncio.ensure_future(self._pipe(client_r, upstream_w, count=True)),
                 asyncio.ensure_future(self._pipe(upstream_r, client_w, count=False))]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            task.cancel()
        for writer in (client_w, upstream_w):
            writer.transport.abort()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, count: bool) -> None:
        held: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await held.get()
                await asyncio.sleep(due - time.monotonic())
                if not data:
                    return
                writer.write(data)
                await writer.drain()

        delivering = asyncio.ensure_future(deliver())
        try:
            while True:
                data = await reader.read(1 << 16)
                if count and data.startswith(METHODS):  # a request's head opens a chunk
                    self.requests += 1
                held.put_nowait((time.monotonic() + self.one_way, data))
                if not data:
                    break
            await delivering
        finally:
            delivering.cancel()


@contextlib.asynccontextmanager
async def proxied(env: BenchEnv, rtt: float) -> AsyncIterator[tuple[DelayProxy, dict[str, str]]]:
    """A delay proxy in front of the bench's engine, and the environment that sends a kernel through it."""
    endpoint = read_endpoint(env.state_dir)
    if endpoint is None:
        raise RuntimeError("the bench's engine is not running")
    async with DelayProxy(int(endpoint.url.rsplit(":", 1)[1]), rtt / 2) as proxy:
        yield proxy, {"CREATEOS_SANDBOX_BASE_URL": f"http://127.0.0.1:{proxy.port}",
                      "CREATEOS_SANDBOX_API_KEY": endpoint.token, ENV_VARS["warm_pool"]: "0"}


async def _starts_and_cells(env: BenchEnv, rtt: float, starts: int, cells: int
                            ) -> tuple[list[float], list[float], float, float]:
    """Start-to-first-result times, trivial-cell times, and requests per start and per cell."""
    start_times: list[float] = []
    cell_times: list[float] = []
    start_requests: list[int] = []
    async with proxied(env, rtt) as (proxy, kernel_env):
        for number in range(starts):
            before = proxy.requests
            started = time.perf_counter()
            async with kernel(SANDBOX, kernel_env) as (_, client):
                await run_ok(client, "1 + 1")
                start_times.append(time.perf_counter() - started)
                start_requests.append(proxy.requests - before)
                if number == starts - 1:
                    for _ in range(3):  # warm-up, as cells.round_trip
                        await run_ok(client, "x = 1")
                    before = proxy.requests
                    for _ in range(cells):
                        cell_times.append((await run_ok(client, "x = 1")).seconds)
                    cell_requests = (proxy.requests - before) / cells
    return start_times, cell_times, statistics.median(start_requests), cell_requests


async def measure(env: BenchEnv, rtt: float, starts: int, cells: int) -> list[Row]:
    near = await _starts_and_cells(env, 0.0, starts, cells)
    far = await _starts_and_cells(env, rtt, starts, cells)
    rows = []
    for label, times, requests, target, most in (
            ("trivial cell (`x = 1`)", 1, 3, "1 round trip", 1.5),
            ("a cold kernel start until its first cell has answered", 0, 2,
             "<= 8 round trips (7 to start, as before)", 8.5)):
        near_p50 = statistics.median(near[times])  # type: ignore[arg-type]
        round_trips = (statistics.median(far[times]) - near_p50) / rtt  # type: ignore[arg-type]
        row = Row(f"cloud, {rtt * 1000:g} ms round trip: {label}", "ms", ms(far[times]), None,  # type: ignore[arg-type]
                  f"{target}; measured {round_trips:.1f} ({far[requests]:g} requests; "
                  f"{near_p50 * 1000:.1f} ms without the delay)")
        row.met = round_trips <= most
        rows.append(row)
    return rows
