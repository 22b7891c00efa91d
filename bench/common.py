"""What every benchmark shares: statistics, a private bench environment, and driving
kernels through jupyter_client as a frontend would.

The environment is isolated from the user's: a temporary state dir (so the local
engine, its token and its sandboxes are the bench's own), and the two kernelspecs under
comparison, "bench-sandbox" (sandbox-kernel, installed with its real CLI) and
"bench-plain" (plain ipykernel), installed into a temporary prefix on JUPYTER_PATH.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jupyter_client.asynchronous.client import AsyncKernelClient
from jupyter_client.manager import AsyncKernelManager

from sandbox_kernel.api import ConflictError, NotFoundError, SandboxClient
from sandbox_kernel.local.service import EngineEndpoint

SANDBOX = "bench-sandbox"
PLAIN = "bench-plain"
START_TIMEOUT = 120.0
CELL_TIMEOUT = 300.0
START_AT_ONCE = 4  # kernels started (or shut down) at a time by kernels()


# -- statistics -----------------------------------------------------------------------------

def p95(values: list[float]) -> float:
    """The nearest-rank 95th percentile (with few samples, close to the maximum)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def summary(name: str, seconds: list[float]) -> str:
    return (f"{name:<8} median {statistics.median(seconds) * 1000:8.1f} ms   "
            f"p95 {p95(seconds) * 1000:8.1f} ms   (n={len(seconds)})")


# -- environment ----------------------------------------------------------------------------

@dataclass
class BenchEnv:
    root: Path
    state_dir: Path
    engine: EngineEndpoint | None = None

    @property
    def engine_pid(self) -> int | None:
        return self.engine.pid if self.engine else None


@contextlib.contextmanager
def bench_env() -> Iterator[BenchEnv]:
    """A private state dir with a running local engine and both kernelspecs installed.

    The engine is started up front so that "cold start" below means a new sandbox, not a
    new engine (which a user pays once per idle period, not per notebook). Everything,
    engine included, is stopped and removed on exit.
    """
    root = Path(tempfile.mkdtemp(prefix="sk-bench-"))
    saved = {name: os.environ.get(name) for name in
             ("SANDBOX_KERNEL_STATE_DIR", "JUPYTER_PATH", "CREATEOS_SANDBOX_API_KEY")}
    env = BenchEnv(root=root, state_dir=root / "state")
    env.state_dir.mkdir(mode=0o700)
    saved_cwd = os.getcwd()
    _compile_package()
    try:
        # Kernels start here (they inherit it): from a source checkout's root, `python -m
        # sandbox_kernel.kernel` would import the checkout rather than the package installed.
        os.chdir(root)
        os.environ["SANDBOX_KERNEL_STATE_DIR"] = str(env.state_dir)
        os.environ.pop("CREATEOS_SANDBOX_API_KEY", None)  # the bench measures the local engine
        prefix = root / "prefix"
        subprocess.run([sys.executable, "-m", "sandbox_kernel", "install", "--prefix", str(prefix),
                        "--name", SANDBOX], check=True, capture_output=True)
        subprocess.run([sys.executable, "-m", "ipykernel", "install", "--prefix", str(prefix),
                        "--name", PLAIN], check=True, capture_output=True)
        os.environ["JUPYTER_PATH"] = str(prefix / "share" / "jupyter")
        from sandbox_kernel.local.service import ensure_engine

        env.engine = ensure_engine(env.state_dir, idle_timeout=600)
        yield env
    finally:
        if env.engine:
            # A stopped engine leaves its sandboxes running for the next one on its state
            # dir; with the state dir removed there is none, and they would run on, orphaned.
            asyncio.run(_destroy_every_sandbox(env.engine))
            with contextlib.suppress(ProcessLookupError):
                os.kill(env.engine.pid, signal.SIGTERM)
            _wait_gone(env.engine.pid, 15.0)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        os.chdir(saved_cwd)
        _remove(root)


def _compile_package() -> None:
    """Compile sandbox-kernel to bytecode where it is installed, as pip does at install (an
    editable install is not compiled, and where PYTHONDONTWRITEBYTECODE is set no import
    writes bytecode): plain ipykernel, installed by pip, starts from bytecode, so ours must
    too for the two to compare (each start would otherwise compile ~70 modules, ~100 ms)."""
    import compileall

    import sandbox_kernel

    compileall.compile_dir(os.path.dirname(sandbox_kernel.__file__), quiet=1)


async def _destroy_every_sandbox(engine: EngineEndpoint) -> None:
    async with SandboxClient(engine.url, engine.token) as api:
        for sandbox in await api.list_sandboxes():
            # On its way out: gone, or being destroyed by its kernel's shutdown (409).
            with contextlib.suppress(NotFoundError, ConflictError):
                await api.delete_sandbox(sandbox.id)


def _remove(root: Path) -> None:
    """Remove the bench's directory; a sandbox's disk volume the engine has just unmounted
    can stay busy for a moment."""
    for _ in range(10):
        shutil.rmtree(root, ignore_errors=True)
        if not root.exists():
            return
        time.sleep(0.5)


def _wait_gone(pid: int, timeout: float) -> None:
    """Wait for the engine to exit, reaping it: ensure_engine started it as our child, and
    an unreaped child stays a zombie that os.kill(pid, 0) still finds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:  # already reaped
            return
        time.sleep(0.05)


# -- kernels --------------------------------------------------------------------------------

@dataclass
class Received:
    """One iopub message of a cell, with the moment (perf_counter) it arrived."""

    at: float
    wall: float  # time.time() at arrival, to compare with times a cell printed
    msg_type: str
    content: dict[str, Any]


@dataclass
class CellRun:
    sent: float
    idle: float
    reply: dict[str, Any]
    messages: list[Received] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return self.idle - self.sent

    def of_type(self, msg_type: str) -> list[Received]:
        return [m for m in self.messages if m.msg_type == msg_type]


Kernel = tuple[AsyncKernelManager, AsyncKernelClient]


async def _start(name: str, env: dict[str, str] | None) -> Kernel:
    manager = AsyncKernelManager(kernel_name=name)
    await manager.start_kernel(env={**os.environ, **(env or {})})
    client = manager.client()
    client.start_channels()
    try:
        await client.wait_for_ready(timeout=START_TIMEOUT)
    except BaseException:
        await _stop((manager, client))
        raise
    return manager, client


async def _stop(started: Kernel) -> None:
    manager, client = started
    client.stop_channels()
    await manager.shutdown_kernel()


@contextlib.asynccontextmanager
async def kernel(name: str, env: dict[str, str] | None = None) -> AsyncIterator[Kernel]:
    """A started, ready kernel of kernelspec `name`: yields (manager, client)."""
    started = await _start(name, env)
    try:
        yield started
    finally:
        await _stop(started)


@contextlib.asynccontextmanager
async def kernels(name: str, count: int, env: dict[str, str] | None = None,
                  at_once: int = START_AT_ONCE) -> AsyncIterator[list[Kernel]]:
    """`count` started kernels of kernelspec `name`, at most `at_once` starting (and, on
    exit, shutting down) at a time: a hundred starting together on two cores would starve
    one another past START_TIMEOUT."""
    gate = asyncio.Semaphore(at_once)

    async def gated(step: Awaitable[Any]) -> Any:
        async with gate:
            return await step

    outcomes = await asyncio.gather(*(gated(_start(name, env)) for _ in range(count)),
                                    return_exceptions=True)
    started = [outcome for outcome in outcomes if not isinstance(outcome, BaseException)]
    try:
        failures = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
        if failures:
            raise RuntimeError(f"{len(failures)} of {count} {name} kernels did not start") from failures[0]
        yield started
    finally:
        await asyncio.gather(*(gated(_stop(each)) for each in started), return_exceptions=True)


async def run_cell(client: AsyncKernelClient, code: str, timeout: float = CELL_TIMEOUT) -> CellRun:
    """Execute `code` and collect its iopub messages until the kernel is idle again."""
    sent = time.perf_counter()
    msg_id = client.execute(code)
    messages: list[Received] = []
    deadline = sent + timeout
    while True:
        msg = await client.get_iopub_msg(timeout=max(0.1, deadline - time.perf_counter()))
        now, wall = time.perf_counter(), time.time()
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            idle = now
            break
        messages.append(Received(now, wall, msg["msg_type"], msg["content"]))
    reply = await client.get_shell_msg(timeout=max(0.1, deadline - time.perf_counter()))
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = await client.get_shell_msg(timeout=max(0.1, deadline - time.perf_counter()))
    return CellRun(sent=sent, idle=idle, reply=reply["content"], messages=messages)


async def run_ok(client: AsyncKernelClient, code: str, timeout: float = CELL_TIMEOUT) -> CellRun:
    """run_cell that fails loudly if the cell did not succeed (a bench of errors is no bench)."""
    run = await run_cell(client, code, timeout)
    if run.reply.get("status") != "ok":
        raise RuntimeError(f"cell failed: {run.reply.get('ename')}: {run.reply.get('evalue')}\n{code}")
    return run


# -- results --------------------------------------------------------------------------------

@dataclass
class Row:
    """One line of the results table; values are in `unit` (ms, MB/s, MiB)."""

    measure: str
    unit: str
    sandbox: list[float]
    plain: list[float] | None = None
    target: str = ""
    met: bool | None = None  # None: no target, only reported

    @property
    def ratio(self) -> float | None:
        if not self.plain:
            return None
        return statistics.median(self.sandbox) / statistics.median(self.plain)


def ms(seconds: list[float]) -> list[float]:
    return [s * 1000 for s in seconds]


def _cell(values: list[float] | None, unit: str) -> str:
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.1f} {unit}"
    return f"{statistics.median(values):.1f} / {p95(values):.1f} {unit}"


def markdown_table(rows: list[Row]) -> str:
    lines = ["| Measure | sandbox p50 / p95 | plain ipykernel p50 / p95 | ratio (p50) | target | met |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        ratio = f"{row.ratio:.2f}" if row.ratio is not None else "–"
        met = {True: "yes", False: "**no**", None: "–"}[row.met]
        lines.append(f"| {row.measure} | {_cell(row.sandbox, row.unit)} | {_cell(row.plain, row.unit)} "
                     f"| {ratio} | {row.target or '–'} | {met} |")
    return "\n".join(lines)
