"""Round trips through a managed process, against one short exec, on the local engine.

    python bench/process_latency.py [--rounds N]

One `cat` runs as a managed process with one connect stream held open (as the kernel's
runner channel will): each round posts one `input` and waits for the data frame that
echoes it. The baseline is one buffered exec of `true` per round (the exec-per-cell path
pays at least this). Prints median and p95 of each in ms, over the engine's unix socket
(the kernel's default) and over loopback TCP (what the vendor SDK uses). Uses the engine
of $SANDBOX_KERNEL_STATE_DIR (started if needed). Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from sandbox_kernel.api import CreateProcessRequest, ProcessFrameType, SandboxClient
from sandbox_kernel.api.models import CreateSandboxRequest
from sandbox_kernel.config import LOCAL_ENGINE_URL_FOR_UDS
from sandbox_kernel.local.service import EngineEndpoint, ensure_engine
from sandbox_kernel.paths import state_dir


def summary(name: str, samples: list[float]) -> str:
    ordered = sorted(samples)
    p95 = ordered[max(0, int(len(ordered) * 0.95) - 1)]
    return f"{name}: median {statistics.median(ordered) * 1000:.2f} ms, p95 {p95 * 1000:.2f} ms (n={len(ordered)})"


async def measure(client: SandboxClient, rounds: int) -> None:
    async with client:
        sandbox_id = (await client.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-512mb"))).id
        try:
            process = await client.create_process(sandbox_id, CreateProcessRequest(cmd="cat"))
            echoed: asyncio.Queue[bytes] = asyncio.Queue()

            async def follow() -> None:
                async with client.connect_process(sandbox_id, process.process_id) as stream:
                    async for frame in stream:
                        if frame.type == ProcessFrameType.DATA:
                            echoed.put_nowait(frame.data)

            follower = asyncio.create_task(follow())
            channel, execs = [], []
            for index in range(rounds + 5):  # the first 5 warm up
                started = time.perf_counter()
                await client.process_input(sandbox_id, process.process_id, b"%d\n" % index)
                echo = asyncio.ensure_future(echoed.get())
                await asyncio.wait({echo, follower}, return_when=asyncio.FIRST_COMPLETED)
                if not echo.done():
                    echo.cancel()
                    follower.result()  # raises what ended the stream
                    raise RuntimeError("the connect stream ended early")
                if index >= 5:
                    channel.append(time.perf_counter() - started)
            for index in range(rounds + 5):
                started = time.perf_counter()
                await client.exec(sandbox_id, "true")
                if index >= 5:
                    execs.append(time.perf_counter() - started)
            follower.cancel()
            print(summary("input -> echoed data frame", channel))
            print(summary("one buffered exec of true", execs))
        finally:
            await client.delete_sandbox(sandbox_id)


def clients(endpoint: EngineEndpoint) -> dict[str, SandboxClient]:
    found = {"tcp": SandboxClient(endpoint.url, endpoint.token)}
    if endpoint.socket:
        found["unix socket"] = SandboxClient(LOCAL_ENGINE_URL_FOR_UDS, endpoint.token, uds=endpoint.socket)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    rounds = parser.parse_args().rounds
    for transport, client in clients(ensure_engine(state_dir())).items():
        print(f"-- over {transport}")
        asyncio.run(measure(client, rounds))


if __name__ == "__main__":
    main()
