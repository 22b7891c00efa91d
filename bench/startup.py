"""Kernel start to first result: from KernelManager.start_kernel until `1 + 1` has answered.

Cold: the sandbox kernel creates a new sandbox (the engine already runs). Warm: it claims
a ready sandbox from a warm pool of one (SANDBOX_KERNEL_WARM_POOL=1), refilled between
starts (the refill is not timed: an open notebook does it in the background).
"""

from __future__ import annotations

import asyncio
import time

from common import PLAIN, SANDBOX, Row, kernel, ms, run_ok
from sandbox_kernel.sandbox import pool
from sandbox_kernel.config import ENV_VARS, Settings

COLD = {ENV_VARS["warm_pool"]: "0"}
WARM = {ENV_VARS["warm_pool"]: "1"}
REFILL_TIMEOUT = 120.0


async def _wait_pool_full(warm: pool.WarmPool) -> None:
    deadline = time.monotonic() + REFILL_TIMEOUT
    while len(warm.members()) < warm.size:
        if time.monotonic() > deadline:
            raise RuntimeError("the warm pool did not refill")
        await asyncio.sleep(0.1)


async def _start_to_first_result(name: str, env: dict[str, str],
                                 warm: pool.WarmPool | None = None) -> float:
    started = time.perf_counter()
    async with kernel(name, env) as (_, client):
        await run_ok(client, "1 + 1")
        took = time.perf_counter() - started
        if warm is not None:  # keep the notebook open until it has refilled the pool
            await _wait_pool_full(warm)
        return took


async def measure(repeat: int) -> list[Row]:
    warm_pool = pool.WarmPool.for_settings(Settings.from_env(), 1)
    times: dict[str, list[float]] = {"plain": [], "cold": [], "warm": []}
    await _start_to_first_result(SANDBOX, WARM, warm_pool)  # fills the pool (and warms caches)
    await _start_to_first_result(PLAIN, {})
    for _ in range(repeat):
        times["plain"].append(await _start_to_first_result(PLAIN, {}))
        times["cold"].append(await _start_to_first_result(SANDBOX, COLD))
        times["warm"].append(await _start_to_first_result(SANDBOX, WARM, warm_pool))
    cold = Row("kernel start to first result, cold (new sandbox)", "ms", ms(times["cold"]),
               ms(times["plain"]), "ratio <= 1.3")
    cold.met = cold.ratio is not None and cold.ratio <= 1.3
    warm = Row("kernel start to first result, warm pool", "ms", ms(times["warm"]),
               ms(times["plain"]), "ratio <= 1.15")
    warm.met = warm.ratio is not None and warm.ratio <= 1.15
    return [cold, warm]
