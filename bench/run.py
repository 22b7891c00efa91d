"""sandbox-kernel against plain ipykernel, side by side in one run.

    python bench/run.py [--quick] [--only NAME ...]

Starts both kernels through jupyter_client (the sandbox kernel on a private local engine),
repeats each measure, and prints a markdown table of medians, p95, the ratio
sandbox/plain and whether each target is met. --quick runs every measure with tiny repeat
counts and a short density run (for the smoke test: the numbers are not meaningful).
Nothing here asserts a time: a missed target is reported, not raised.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import cells
import cloud
import density
import lifecycle
import startup
from common import PLAIN, SANDBOX, BenchEnv, Row, bench_env, kernel, markdown_table


@dataclass(frozen=True)
class Plan:
    """Repeat counts: meaningful by default, tiny with --quick."""

    round_trip: int = 50
    # The first chunk's p50 came out 1.27 to 1.63 of plain's at one commit with 10: each sample
    # follows an idle moment, whose wake-ups vary most (docs/performance.md).
    streaming: int = 30
    throughput: int = 9  # the plain column swings most here (one 20 MiB message): more samples
    flood_mib: int = 20
    rich: int = 5
    frame_mb: float = 10.0
    starts: int = 8
    lifecycle: int = 10
    lifecycle_mib: int = 200
    fan_out_batches: int = 3  # each: 10 forks of one source
    density_kernels: int = 100
    density_interval: float = 5.0  # seconds between one notebook's cells
    density_seconds: float = 60.0
    cloud_starts: int = 5
    cloud_rtt: float = 0.030
    idle_notebooks: int = 100  # notebooks left idle through the delay proxy (cloud.idle_cost)
    idle_rtts: tuple[float, ...] = (0.030, 0.080)
    idle_seconds: float = 120.0
    idle_paused: bool = True  # also count once the sandboxes auto-paused (a minute's wait more)


QUICK = Plan(round_trip=3, streaming=1, throughput=1, flood_mib=1, rich=1, frame_mb=0.2, starts=1,
             lifecycle=1, lifecycle_mib=20, fan_out_batches=1, density_kernels=1, density_interval=1.0,
             density_seconds=2.0, cloud_starts=1, idle_notebooks=1, idle_rtts=(0.030,), idle_seconds=2.0,
             idle_paused=False)


async def cell_measures(plan: Plan, env: BenchEnv) -> list[Row]:
    async with kernel(SANDBOX) as (_, sandbox), kernel(PLAIN) as (_, plain):
        rows = [await cells.round_trip(sandbox, plain, plan.round_trip)]
        rows += await cells.streaming(sandbox, plain, plan.streaming)
        rows.append(await cells.background_print(sandbox, plain, plan.streaming))
        rows.append(await cells.throughput(sandbox, plain, plan.throughput, plan.flood_mib))
        rows += await cells.rich_output(sandbox, plain, plan.rich, plan.frame_mb)
        return rows


async def cloud_measures(plan: Plan, env: BenchEnv) -> list[Row]:
    rows = await cloud.measure(env, plan.cloud_rtt, plan.cloud_starts, plan.round_trip)
    return rows + await cloud.idle_cost(env, plan.idle_notebooks, plan.idle_rtts, plan.density_interval,
                                        plan.idle_seconds, plan.idle_paused)


MEASURES: dict[str, Callable[[Plan, BenchEnv], Awaitable[list[Row]]]] = {
    "cells": cell_measures,
    "startup": lambda plan, env: startup.measure(plan.starts),
    "lifecycle": lambda plan, env: lifecycle.rows(plan.lifecycle, plan.lifecycle_mib, plan.fan_out_batches),
    "density": lambda plan, env: density.measure(env, plan.density_kernels, plan.density_interval,
                                                  plan.density_seconds),
    "cloud": cloud_measures,
}


async def run(names: list[str], plan: Plan, env: BenchEnv) -> list[Row]:
    rows: list[Row] = []
    for name in names:
        started = time.monotonic()
        print(f"[bench] {name}…", file=sys.stderr, flush=True)
        rows += await MEASURES[name](plan, env)
        print(f"[bench] {name} took {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny repeat counts (smoke test)")
    parser.add_argument("--only", nargs="+", choices=list(MEASURES), help="run only these measures")
    args = parser.parse_args()
    plan = QUICK if args.quick else Plan()
    started = time.monotonic()
    with bench_env() as env:
        rows = asyncio.run(run(args.only or list(MEASURES), plan, env))
        # Before the clean-up, which a failure must not cost the numbers.
        print(markdown_table(rows))
        print(f"\n{os.cpu_count()} CPUs, {time.monotonic() - started:.0f} s in all"
              + (" (--quick: repeat counts too small for meaningful numbers)" if args.quick else ""), flush=True)


if __name__ == "__main__":
    main()
