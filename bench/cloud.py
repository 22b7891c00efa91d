"""The cloud case: the same cells with a simulated round trip between kernel and engine.

The sandbox kernel reaches the bench's engine through a delay proxy on loopback, on the
CreateOS code path (base URL and API key, as for the cloud). The proxy holds every chunk,
each way, for half the round trip. It counts requests, and round trips in sequence: a
request sent while no other is waiting for its answer's head starts a new round trip, one
sent while another waits rides along (the three runner files uploaded at once are one).
A process's output stream waits only for its head. Starts and cells also run alternately
through a proxy without delay, and the rows give both times.

idle_cost: many notebooks open through the proxy, each run one cell, then left idle; the
requests they send while idle (per notebook per minute, by method and route) are what an
idle notebook costs the service.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import statistics
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable

from jupyter_client.asynchronous.client import AsyncKernelClient

from common import SANDBOX, BenchEnv, Row, kernel, kernels, ms, run_ok
from sandbox_kernel.api import SandboxClient
from sandbox_kernel.api.models import AUTO_PAUSE_MIN_SECONDS, PatchSandboxRequest, SandboxStatus
from sandbox_kernel.config import ENV_VARS
from sandbox_kernel.local.service import read_endpoint

METHODS = (b"GET ", b"POST ", b"PUT ", b"DELETE ", b"PATCH ")
# A path segment after one of these names an instance (sandbox, process...): counted as ":id".
AN_ID = re.compile(r"/(sandboxes|processes|disks|screens|windows|snapshots)/(?!by-ip(?:/|$))[^/?]+")
IDLE_SETTLE = 5.0  # seconds after the last cell before idle requests are counted
PAUSE_WAIT = 60.0  # seconds past the auto-pause timeout for every idle sandbox to have paused


def route(request_line: bytes) -> str:
    """A request's method and path, ids replaced and query values dropped:
    'GET /v1/sandboxes/sb-1/processes/7?after=3 HTTP/1.1' -> 'GET /v1/sandboxes/:id/processes/:id?after'."""
    method, target = (request_line.decode("latin-1").split(" ") + ["", ""])[:2]
    path, _, query = target.partition("?")
    keys = sorted({pair.partition("=")[0] for pair in query.split("&") if pair})
    path = AN_ID.sub(r"/\1/:id", path)
    return f"{method} {path}" + (f"?{'&'.join(keys)}" if keys else "")


class DelayProxy:
    """A loopback TCP proxy that delivers each chunk `one_way` seconds after it arrived,
    in order, in both directions; counts requests and round trips (see the module docstring)."""

    def __init__(self, upstream_port: int, one_way: float) -> None:
        self.upstream_port = upstream_port
        self.one_way = one_way
        self.requests = 0
        self.routes: Counter[str] = Counter()  # requests by route()
        self.answer_bytes = 0  # everything the service sent (answers, stream frames)
        self._open: set[asyncio.StreamWriter] = set()  # the kernels' ends of the connections open now
        self.round_trips = 0
        self._waiting = 0  # requests sent whose answer has not begun
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
        self._open.add(client_w)
        tasks = [asyncio.ensure_future(self._pipe(client_r, upstream_w, self._request_seen)),
                 asyncio.ensure_future(self._pipe(upstream_r, client_w, self._answer_seen))]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            task.cancel()
        for writer in (client_w, upstream_w):
            writer.transport.abort()
        self._open.discard(client_w)

    @property
    def connections(self) -> int:
        return len(self._open)

    def cut_all(self) -> None:
        """Drop every open connection, as a gateway restarting or a network change would."""
        for writer in list(self._open):
            writer.transport.abort()

    def _request_seen(self, data: bytes) -> None:
        if data.startswith(METHODS):  # one request at a time per connection: its head opens a chunk
            self.requests += 1
            self.routes[route(data.split(b"\r\n", 1)[0])] += 1
            if self._waiting == 0:
                self.round_trips += 1
            self._waiting += 1

    def _answer_seen(self, data: bytes) -> None:
        self.answer_bytes += len(data)
        if data.startswith(b"HTTP/1.") and self._waiting:
            self._waiting -= 1

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    seen: Callable[[bytes], None]) -> None:
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
                seen(data)
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


async def measure(env: BenchEnv, rtt: float, starts: int, cells: int) -> list[Row]:
    """Cold starts, then trivial cells, each alternately without and with the delay (so a
    burst of load on the machine hits both)."""
    times: dict[str, dict[str, list[float]]] = {"start": {"near": [], "far": []}, "cell": {"near": [], "far": []}}
    counts: dict[str, list[int]] = {"start requests": [], "start round trips": []}
    async with proxied(env, 0.0) as (_, near_env), proxied(env, rtt) as (far, far_env):
        paths = {"near": near_env, "far": far_env}
        for _ in range(starts):
            for name, kernel_env in paths.items():
                requests, round_trips = far.requests, far.round_trips
                started = time.perf_counter()
                async with kernel(SANDBOX, kernel_env) as (_, client):
                    await run_ok(client, "1 + 1")
                    times["start"][name].append(time.perf_counter() - started)
                    if name == "far":
                        counts["start requests"].append(far.requests - requests)
                        counts["start round trips"].append(far.round_trips - round_trips)
        async with kernel(SANDBOX, near_env) as (_, near_client), kernel(SANDBOX, far_env) as (_, far_client):
            clients = {"near": near_client, "far": far_client}
            for client in clients.values():
                for _ in range(3):  # warm-up, as cells.round_trip
                    await run_ok(client, "x = 1")
            requests, round_trips = far.requests, far.round_trips
            for _ in range(cells):
                for name, client in clients.items():
                    times["cell"][name].append((await run_ok(client, "x = 1")).seconds)
            cell_counts = ((far.requests - requests) / cells, (far.round_trips - round_trips) / cells)
    rows = []
    for label, kind, (requests_made, round_trips_made), target, most in (
            ("trivial cell (`x = 1`)", "cell", cell_counts, "1 round trip", 1),
            ("a cold kernel start until its first cell has answered", "start",
             (statistics.median(counts["start requests"]), statistics.median(counts["start round trips"])),
             "<= 6 round trips (the create; the setup's uploads and look; the runner's start; "
             "its relay; the relay's stream; the cell)", 6)):
        row = Row(f"cloud, {rtt * 1000:g} ms round trip: {label}", "ms", ms(times[kind]["far"]), None,
                  f"{target}; {round_trips_made:g} round trips, {requests_made:g} requests "
                  f"({statistics.median(times[kind]['near']) * 1000:.1f} ms without the delay)")
        row.met = round_trips_made <= most
        rows.append(row)
    return rows


async def _idle_requests(proxy: DelayProxy, count: int, seconds: float, label: str) -> Row:
    """Wait `seconds` while the proxy counts what `count` idle notebooks send; the row gives
    requests per notebook per minute, by route, and the service's bytes and open connections."""
    before, bytes_before = proxy.routes.copy(), proxy.answer_bytes
    await asyncio.sleep(seconds)
    sent = proxy.routes - before
    per_minute = 60 / seconds / count
    received = (proxy.answer_bytes - bytes_before) * per_minute
    breakdown = ", ".join(f"{name} {times * per_minute:.2f}" for name, times in sent.most_common())
    row = Row(f"{label}: requests per notebook per minute ({seconds:.0f} s counted; by route: "
              f"{breakdown or 'none'}; meanwhile the service sent {received:.0f} bytes per notebook per "
              f"minute (stream heartbeats) and {proxy.connections / count:.1f} connections per notebook "
              "were open)", "requests/min", [sum(sent.values()) * per_minute], target="next to nothing: < 1")
    row.met = row.sandbox[0] < 1
    return row


async def _pause_all(env: BenchEnv, count: int) -> None:
    """Set every sandbox's auto-pause to the shortest CreateOS allows, and wait until all
    `count` have paused themselves. Straight to the engine: the proxy does not count this."""
    endpoint = read_endpoint(env.state_dir)
    assert endpoint is not None
    async with SandboxClient(endpoint.url, endpoint.token) as api:
        for sandbox in await api.list_sandboxes():
            await api.patch_sandbox(sandbox.id, PatchSandboxRequest(auto_pause_after_seconds=AUTO_PAUSE_MIN_SECONDS))
        deadline = time.monotonic() + AUTO_PAUSE_MIN_SECONDS + PAUSE_WAIT
        while len(await api.list_sandboxes(status=SandboxStatus.PAUSED.value)) < count:
            if time.monotonic() > deadline:
                raise RuntimeError("the idle sandboxes did not all auto-pause in "
                                   f"{AUTO_PAUSE_MIN_SECONDS + PAUSE_WAIT:.0f} s")
            await asyncio.sleep(5)


async def idle_cost(env: BenchEnv, count: int, rtts: tuple[float, ...], interval: float,
                    idle_seconds: float, paused: bool) -> list[Row]:
    """`count` notebooks open through the delay proxy; at each round trip time, every notebook
    runs one cell (at a random moment of `interval`), then all stay idle for `idle_seconds`
    while the proxy counts the requests they send. Last (if `paused`), the same once their
    sandboxes have auto-paused, the notebooks still open; and again after the proxy has cut
    every connection once (what a paused notebook does when its output stream drops)."""
    rows = []
    async with proxied(env, rtts[0]) as (proxy, kernel_env), kernels(SANDBOX, count, kernel_env) as notebooks:
        phases = random.Random(33)

        async def one_cell(client: AsyncKernelClient, phase: float) -> float:
            await asyncio.sleep(phase)
            return (await run_ok(client, "x = 1")).seconds

        for rtt in rtts:
            proxy.one_way = rtt / 2
            latencies = await asyncio.gather(*(one_cell(client, phases.uniform(0, interval))
                                               for _, client in notebooks))
            label = f"cloud, {rtt * 1000:g} ms round trip, {count} notebooks"
            rows.append(Row(f"{label}: one cell in each (random moment in {interval:g} s)", "ms",
                            ms(latencies), target="reported"))
            await asyncio.sleep(IDLE_SETTLE)
            rows.append(await _idle_requests(proxy, count, idle_seconds, f"{label}, idle after one cell each"))
        if paused:
            await _pause_all(env, count)
            rows.append(await _idle_requests(proxy, count, idle_seconds,
                                             f"{label}, idle with their sandboxes auto-paused"))
            proxy.cut_all()
            rows.append(await _idle_requests(proxy, count, idle_seconds,
                                             f"{label}, auto-paused, once their connections were cut"))
    return rows
