"""Density: many notebooks with sandboxes open at once, each running a cell every second.

Then, with all of them idle, the memory each costs, as PSS (see memory.py): per sandbox,
its processes (bwrap, agent, runner with IPython) plus an equal share of the engine's;
per notebook, the kernel process on the host, next to a plain ipykernel's (as many plain
kernels as sandbox kernels, so shared pages are split alike).
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time

from jupyter_client.asynchronous.client import AsyncKernelClient

from common import PLAIN, SANDBOX, BenchEnv, Row, kernel, ms, run_cell
from memory import command_line, pss_bytes, sandbox_processes

MIB = 2**20
TICK = 1.0
SETTLE = 3.0  # seconds of idleness before memory is read
WHICH_SANDBOX = "import os; print(os.environ['SANDBOX_ID'])"


async def _tick_cells(client: AsyncKernelClient, seconds: float) -> tuple[int, list[float]]:
    """Run a cell at every TICK for `seconds`; return (failures, latencies)."""
    latencies: list[float] = []
    failures = 0
    started = time.monotonic()
    for tick in range(int(seconds / TICK)):
        await asyncio.sleep(max(0.0, started + tick * TICK - time.monotonic()))
        run = await run_cell(client, "n = globals().get('n', 0) + 1")
        if run.reply.get("status") == "ok":
            latencies.append(run.seconds)
        else:
            failures += 1
    return failures, latencies


async def measure(env: BenchEnv, count: int, seconds: float) -> list[Row]:
    async with contextlib.AsyncExitStack() as stack:
        sandboxes = await asyncio.gather(*(stack.enter_async_context(kernel(SANDBOX)) for _ in range(count)))
        plains = await asyncio.gather(*(stack.enter_async_context(kernel(PLAIN)) for _ in range(count)))
        ids = [(await run_cell(client, WHICH_SANDBOX)).of_type("stream")[-1].content["text"].strip()
               for _, client in sandboxes]
        for _, client in plains:
            await run_cell(client, "n = 0")
        results = await asyncio.gather(*(_tick_cells(client, seconds) for _, client in sandboxes))
        await asyncio.sleep(SETTLE)
        processes = [sandbox_processes(sandbox_id) for sandbox_id in ids]
        per_sandbox = [sum(pss_bytes(pid) for pid in pids) for pids in processes]
        runners = [sum(pss_bytes(pid) for pid in pids if "runner.py serve" in command_line(pid))
                   for pids in processes]
        engine_share = pss_bytes(env.engine_pid or 0) / count
        host_kernels = [pss_bytes(manager.provisioner.process.pid) for manager, _ in sandboxes]
        plain_kernels = [pss_bytes(manager.provisioner.process.pid) for manager, _ in plains]
    expected = count * int(seconds / TICK)
    latencies = [latency for _, cell_times in results for latency in cell_times]
    failures = sum(failed for failed, _ in results)
    cells = Row(f"density: {count} notebooks, a cell every second for {seconds:.0f} s: cell round trip "
                f"({len(latencies)}/{expected} cells ok)", "ms", ms(latencies),
                target="every cell completes")
    cells.met = failures == 0 and len(latencies) == expected
    memory = Row(f"memory per idle sandbox, PSS (agent + runner + bwrap + engine/{count}) "
                 "vs plain ipykernel process", "MiB",
                 [(own + engine_share) / MIB for own in per_sandbox],
                 [size / MIB for size in plain_kernels], "<= 40 MB")
    memory.met = statistics.median(memory.sandbox) * MIB <= 40e6
    runner = Row("of which the runner (Python + IPython holding the notebook's globals)", "MiB",
                 [size / MIB for size in runners])
    host = Row("memory of the sandbox kernel's own process on the host, PSS (vs plain ipykernel)",
               "MiB", [size / MIB for size in host_kernels], [size / MIB for size in plain_kernels])
    return [cells, memory, runner, host]
