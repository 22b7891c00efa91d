"""Where a sandbox start and a cell spend their time, on the kernel's side of the API.

    python bench/profile.py [--cells N]

Drives the SandboxSession the kernel uses (private engine, as bench/run.py) under
pyinstrument (from the `bench` extra): one sandbox start, then N trivial cells. It is a
wall-clock profile, so time spent waiting on the engine and the sandbox shows up as
`[await]` under the session frame that waits. The sandbox side is timed by `layers`:
a bare exec, a bare Python start and a runner request, each as the client sees it.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

from pyinstrument import Profiler

from common import bench_env
from sandbox_kernel.config import Settings
from sandbox_kernel.sandbox.session import SANDBOX_PYTHON, SandboxSession


async def median_ms(action: Callable[[], Awaitable[Any]], repeat: int) -> float:
    seconds = []
    for _ in range(repeat):
        started = time.perf_counter()
        await action()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds) * 1000


async def layers(session: SandboxSession, repeat: int) -> None:
    client, sandbox_id = session._require()
    for name, action in (
            ("GET the sandbox (one API round trip)", lambda: client.get_sandbox(sandbox_id)),
            ("exec `true`", lambda: client.exec(sandbox_id, "true", [])),
            ("exec a bare Python", lambda: client.exec(sandbox_id, SANDBOX_PYTHON, ["-I", "-S", "-c", "pass"])),
            ("runner request (info)", lambda: session.runner_request({"op": "info"}))):
        print(f"{name:<40} median {await median_ms(action, repeat):6.1f} ms")


async def profile(cells: int) -> None:
    async def ignore(event: dict) -> None:
        pass

    profiler = Profiler(async_mode="enabled")
    session = SandboxSession(Settings(provider="local"))
    profiler.start()
    await session.start()
    for number in range(cells):
        await session.run_cell(f"profile-{number}", "x = 1", ignore)
    profiler.stop()
    try:
        await layers(session, cells)
    finally:
        await session.shutdown()
    print(profiler.output_text(color=False, unicode=False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=50)
    args = parser.parse_args()
    with bench_env():
        asyncio.run(profile(args.cells))


if __name__ == "__main__":
    main()
