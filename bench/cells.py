"""Measures of running cells on an already started kernel: round trip, streaming, rich output.

Each function gets one client per kernel under comparison and returns samples; both kernels
run the very same cells, alternately, so a burst of load on the machine hits both.
"""

from __future__ import annotations

import statistics

from jupyter_client.asynchronous.client import AsyncKernelClient

import time

from common import Row, ms, p95, run_ok

PRINT_EVERY_10_MS = """\
import time
for _ in range(30):
    print(time.time(), flush=True)
    time.sleep(0.01)
"""
FLOOD = """\
import sys
line = "x" * 1023 + "\\n"
for _ in range({mib} * 1024):
    sys.stdout.write(line)
"""
BACKGROUND_PRINT = """\
import threading, time
def later():
    time.sleep(0.2)
    print(time.time(), flush=True)
threading.Thread(target=later).start()
"""
BACKGROUND_TIMEOUT = 5.0
PLOT_SETUP = "import matplotlib.pyplot as plt"
PLOT = "fig, ax = plt.subplots(); ax.plot(range(100)); plt.show()"
HTML_BYTES_PER_ROW = 180  # ten integer columns, about 10 MB of HTML for 55,000 rows
FRAME_SETUP = """\
import numpy as np, pandas as pd
pd.set_option("display.max_rows", None)
pd.set_option("display.max_columns", None)
frame = pd.DataFrame(np.arange({rows} * 10).reshape({rows}, 10))
"""


async def round_trip(sandbox: AsyncKernelClient, plain: AsyncKernelClient, repeat: int) -> Row:
    times: dict[str, list[float]] = {"sandbox": [], "plain": []}
    for _ in range(3):  # warm-up: imports, first-cell status line, caches
        await run_ok(sandbox, "x = 1")
        await run_ok(plain, "x = 1")
    for _ in range(repeat):
        for name, client in (("sandbox", sandbox), ("plain", plain)):
            times[name].append((await run_ok(client, "x = 1")).seconds)
    row = Row("trivial cell round trip (`x = 1`)", "ms", ms(times["sandbox"]), ms(times["plain"]),
              "ratio <= 2.0")
    row.met = row.ratio is not None and row.ratio <= 2.0
    return row


async def streaming(sandbox: AsyncKernelClient, plain: AsyncKernelClient, repeat: int) -> list[Row]:
    """First chunk from submission, and each chunk's lag from its print() to its arrival."""
    first: dict[str, list[float]] = {"sandbox": [], "plain": []}
    lag: dict[str, list[float]] = {"sandbox": [], "plain": []}
    for _ in range(repeat):
        for name, client in (("sandbox", sandbox), ("plain", plain)):
            run = await run_ok(client, PRINT_EVERY_10_MS)
            chunks = [m for m in run.of_type("stream") if m.content["name"] == "stdout"]
            first[name].append(chunks[0].at - run.sent)
            pending = ""
            for chunk in chunks:  # a line is shown once the chunk that ends it arrives
                pending += chunk.content["text"]
                *lines, pending = pending.split("\n")
                lag[name] += [chunk.wall - float(line) for line in lines]
    first_row = Row("streaming: first chunk of a cell printing every 10 ms", "ms",
                    ms(first["sandbox"]), ms(first["plain"]), "ratio <= 1.3")
    first_row.met = first_row.ratio is not None and first_row.ratio <= 1.3
    lag_row = Row("streaming: lag of each line, print() to frontend", "ms",
                  ms(lag["sandbox"]), ms(lag["plain"]), "p95 <= 3 x plain's p95")
    lag_row.met = p95(lag_row.sandbox) <= 3 * p95(lag_row.plain)
    return [first_row, lag_row]


async def background_print(sandbox: AsyncKernelClient, plain: AsyncKernelClient, repeat: int) -> Row:
    """A thread's print after its cell has ended: from print() to the frontend."""
    lag: dict[str, list[float]] = {"sandbox": [], "plain": []}
    for _ in range(repeat):
        for name, client in (("sandbox", sandbox), ("plain", plain)):
            await run_ok(client, BACKGROUND_PRINT)
            deadline = time.monotonic() + BACKGROUND_TIMEOUT
            while True:
                msg = await client.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
                if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
                    lag[name].append(time.time() - float(msg["content"]["text"].split()[0]))
                    break
    row = Row("a background thread's print between cells, print() to frontend", "ms",
              ms(lag["sandbox"]), ms(lag["plain"]), "p50 <= 100 ms")
    row.met = statistics.median(row.sandbox) <= 100
    return row


async def throughput(sandbox: AsyncKernelClient, plain: AsyncKernelClient, repeat: int,
                     mib: int) -> Row:
    rates: dict[str, list[float]] = {"sandbox": [], "plain": []}
    for _ in range(repeat):
        for name, client in (("sandbox", sandbox), ("plain", plain)):
            run = await run_ok(client, FLOOD.format(mib=mib))
            received = sum(len(m.content["text"]) for m in run.of_type("stream"))
            if received < mib * 2**20:  # a cap that drops output would flatter the rate
                raise RuntimeError(f"{name}: only {received} of {mib} MiB of output arrived")
            rates[name].append(mib / run.seconds)
    row = Row(f"streaming: throughput of a cell printing {mib} MiB", "MiB/s",
              rates["sandbox"], rates["plain"], ">= 100 % of plain")
    row.met = row.ratio is not None and row.ratio >= 1.0
    return row


async def _rich(sandbox: AsyncKernelClient, plain: AsyncKernelClient, repeat: int,
                setup: str, code: str, mime: str, min_bytes: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"sandbox": [], "plain": []}
    for client in (sandbox, plain):
        await run_ok(client, setup)
    for _ in range(repeat):
        for name, client in (("sandbox", sandbox), ("plain", plain)):
            run = await run_ok(client, code)
            sizes = [len(m.content["data"].get(mime, "")) for m in run.messages
                     if m.msg_type in ("display_data", "execute_result")]
            if not sizes or max(sizes) < min_bytes:
                raise RuntimeError(f"{name}: no {mime} output of {min_bytes} bytes or more")
            times[name].append(run.seconds)
    return times


async def rich_output(sandbox: AsyncKernelClient, plain: AsyncKernelClient, repeat: int,
                      frame_mb: float) -> list[Row]:
    plot = await _rich(sandbox, plain, repeat, PLOT_SETUP, PLOT, "image/png", 1000)
    rows = int(frame_mb * 1e6 / HTML_BYTES_PER_ROW)
    frame = await _rich(sandbox, plain, repeat, FRAME_SETUP.format(rows=rows), "frame", "text/html",
                        int(frame_mb * 1e6))
    return [Row("matplotlib PNG round trip", "ms", ms(plot["sandbox"]), ms(plot["plain"]), "reported"),
            Row(f"{frame_mb:g} MB DataFrame HTML repr round trip", "ms", ms(frame["sandbox"]),
                ms(frame["plain"]), "reported")]
