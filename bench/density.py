"""Density: many notebooks open at once on one machine, each running a cell every few seconds.

Each notebook runs a trivial cell every `interval` seconds from a random phase of its own
(so cells do not arrive in lockstep): every cell must be answered. Then, with all of them
idle, the memory each costs, as PSS (see memory.py): per notebook, the sandbox kernel's
process on the host plus its sandbox's (bwrap, agent, runner); the engine's, which all
sandboxes share, on its own row. Plain ipykernel does the same with as many kernels (so
shared pages are split alike), AFTER the sandbox side, not alongside: a hundred of each on
two cores at once would load each side with the other's cells, and both sides' memory
together would crowd a small machine.
"""

from __future__ import annotations

import asyncio
import queue
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

from jupyter_client.asynchronous.client import AsyncKernelClient

from common import PLAIN, SANDBOX, BenchEnv, Row, kernels, ms, run_cell
from memory import ROLES, process_role, pss_bytes, sandbox_processes

MIB = 2**20
SETTLE = 3.0  # seconds of idleness before memory is read
CELL = "n = globals().get('n', 0) + 1"
CELL_WAIT = 120.0  # a cell not answered by then counts as lost
WHICH_SANDBOX = "import os; print(os.environ['SANDBOX_ID'])"
PHASES_SEED = 33  # the same phases run after run, so runs compare


@dataclass
class Side:
    """What one kind of kernel did: cells sent and answered, then memory while idle."""

    cells_sent: int = 0
    latencies: list[float] = field(default_factory=list)  # of answered cells, seconds
    kernel_pss: list[int] = field(default_factory=list)  # each kernel's own process
    sandbox_pss: list[int] = field(default_factory=list)  # each sandbox's processes
    role_pss: dict[str, list[int]] = field(default_factory=dict)  # memory.ROLES -> each sandbox's
    engine_pss: int = 0


async def _notebook(client: AsyncKernelClient, phase: float, interval: float, cells: int,
                    side: Side) -> None:
    """Run `cells` cells, the k-th due at phase + k * interval (later if the previous one is
    still running: a frontend sends the next cell only after it has the previous one's answer)."""
    started = time.monotonic() + phase
    for k in range(cells):
        await asyncio.sleep(max(0.0, started + k * interval - time.monotonic()))
        side.cells_sent += 1
        try:
            run = await run_cell(client, CELL, timeout=CELL_WAIT)
        except queue.Empty:  # no answer in CELL_WAIT: lost
            continue
        if run.reply.get("status") == "ok":
            side.latencies.append(run.seconds)


async def _run_side(name: str, env: BenchEnv, count: int, interval: float, seconds: float) -> Side:
    side = Side()
    phases = random.Random(PHASES_SEED)
    started = time.monotonic()
    async with kernels(name, count) as notebooks:
        _progress(f"{count} {name} kernels started in {time.monotonic() - started:.0f} s")
        clients = [client for _, client in notebooks]
        if name == SANDBOX:
            firsts = await asyncio.gather(*(run_cell(client, WHICH_SANDBOX) for client in clients))
            ids = [first.of_type("stream")[-1].content["text"].strip() for first in firsts]
        else:
            await asyncio.gather(*(run_cell(client, "n = 0") for client in clients))
        cells = max(1, int(seconds / interval))
        await asyncio.gather(*(_notebook(client, phases.uniform(0, interval), interval, cells, side)
                               for client in clients))
        _progress(f"{name}: {len(side.latencies)}/{side.cells_sent} cells answered")
        await asyncio.sleep(SETTLE)
        side.kernel_pss = [pss_bytes(manager.provisioner.process.pid) for manager, _ in notebooks]
        if name == SANDBOX:
            processes = [sandbox_processes(sandbox_id) for sandbox_id in ids]
            side.sandbox_pss = [sum(pss_bytes(pid) for pid in pids) for pids in processes]
            roles = [[(process_role(pid), pss_bytes(pid)) for pid in pids] for pids in processes]
            side.role_pss = {role: [sum(size for of, size in sandbox if of == role) for sandbox in roles]
                             for role in ROLES}
            side.engine_pss = pss_bytes(env.engine_pid or 0)
    return side


def _progress(line: str) -> None:
    print(f"[bench] density: {line}", file=sys.stderr, flush=True)


def _answered(side: Side) -> str:
    return f"{len(side.latencies)}/{side.cells_sent}"


async def measure(env: BenchEnv, count: int, interval: float, seconds: float) -> list[Row]:
    sandbox = await _run_side(SANDBOX, env, count, interval, seconds)
    plain = await _run_side(PLAIN, env, count, interval, seconds)
    expected = count * max(1, int(seconds / interval))
    cells = Row(f"density: {count} notebooks, a cell every {interval:g} s (random phase) for {seconds:.0f} s: "
                f"cell round trip ({_answered(sandbox)} sandbox cells answered, {_answered(plain)} plain; "
                "the plain kernels run after the sandbox ones, not alongside)", "ms",
                ms(sandbox.latencies), ms(plain.latencies), "every cell answered, p50 <= 100 ms")
    cells.met = (sandbox.cells_sent == expected == len(sandbox.latencies)
                 and statistics.median(sandbox.latencies) <= 0.100)
    notebook = Row("memory per idle notebook, PSS: the sandbox kernel's process + its sandbox's "
                   "(bwrap, agent, runner) vs a plain ipykernel process", "MiB",
                   [(own + box) / MIB for own, box in zip(sandbox.kernel_pss, sandbox.sandbox_pss)],
                   [size / MIB for size in plain.kernel_pss], "reported")
    engine_share = sandbox.engine_pss / count
    per_sandbox = Row(f"memory per idle sandbox, PSS (agent + runner + bwrap + engine/{count}) "
                      "vs plain ipykernel process", "MiB",
                      [(own + engine_share) / MIB for own in sandbox.sandbox_pss],
                      [size / MIB for size in plain.kernel_pss], "<= 30 MiB")
    per_sandbox.met = statistics.median(per_sandbox.sandbox) <= 30
    runner = Row("of which the runner (Python + IPython holding the notebook's globals)", "MiB",
                 [size / MIB for size in sandbox.role_pss["runner"]])
    agent = Row("of which the agent (the local engine's, in every sandbox)", "MiB",
                [size / MIB for size in sandbox.role_pss["agent"]])
    helpers = Row("of which the runner's warden (a waiting shell) and the kernel's relay (cat, once the runner has its pipes)", "MiB",
                  [(warden + relay) / MIB for warden, relay in zip(sandbox.role_pss["warden"],
                                                                   sandbox.role_pss["relay"])])
    host = Row("memory of the sandbox kernel's own process on the host, PSS (vs plain ipykernel)",
               "MiB", [size / MIB for size in sandbox.kernel_pss], [size / MIB for size in plain.kernel_pss],
               "<= plain + 4 MiB")
    if host.sandbox and host.plain:
        host.met = statistics.median(host.sandbox) <= statistics.median(host.plain) + 4
    engine = Row(f"memory of the local engine, PSS (one process for all {count} sandboxes)", "MiB",
                 [sandbox.engine_pss / MIB])
    return [cells, notebook, per_sandbox, runner, agent, helpers, host, engine]

