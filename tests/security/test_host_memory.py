"""Nothing a sandbox writes grows the kernel's or the engine's memory without bound
(issue 12, item 2). Each attack first shows it ran (the bytes were really sent or read),
then that the peak memory of the kernel and the engine grew by less than a stated bound.

The runner's client (runner_setup.RUNNER_CLIENT_PATH) lives where sandbox code can
write, so the kernel does not trust it: every line it reads is bounded, and buffered exec
output is capped by the engine. The same holds for the channel's stdout (the relay's, which
the runner daemon writes), which any code in the sandbox can write to.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from jupyter_client.blocking.client import BlockingKernelClient
from jupyter_client.manager import KernelManager

from attack_helpers import ONCE
from fault_proxy import proxied_engine
from kernel_helpers import execute, running_kernel
from memory_probe import MIB, memory_growth
from sandbox_kernel.api import CreateSandboxRequest, SandboxClient
from sandbox_kernel.local.server import MAX_BUFFERED_OUTPUT
from sandbox_kernel.local.service import EngineEndpoint
from sandbox_kernel.sandbox.runner_setup import RUNNER_CLIENT_PATH

pytestmark = [pytest.mark.slow, ONCE]

# Of the kernel with a 2 MiB output limit: it holds at most 3 MiB of one line.
KERNEL_BOUND_MIB = 64
ENGINE_BOUND_MIB = 64
# A buffered exec returns 8 MiB of output: the engine holds it, then its JSON.
BUFFERED_BOUND_MIB = 128

# A runner client (imported, its main called) that puts the real one back for the next exec,
# then writes N MiB of 'x' with no newline: what code in the sandbox can make the kernel's
# next exec read.
EVIL_CLIENT = '''
import os, sys
os.replace(__file__ + ".orig", __file__)
def main(argv):
    block = b"x" * (1 << 20)
    for _ in range({mib}):
        sys.stdout.buffer.write(block)
    sys.stdout.buffer.flush()
    return 0
'''


def install_evil_client(kc: BlockingKernelClient, mib: int) -> None:
    run = execute(kc, f"""
import shutil
client = {RUNNER_CLIENT_PATH!r}
shutil.copy(client, client + '.orig')
open(client, 'w').write({EVIL_CLIENT.format(mib=mib)!r})
""")
    assert run.reply["content"]["status"] == "ok", run.text("stderr")


@pytest.fixture(scope="module")
def kernel(kernelspec: str, engine: EngineEndpoint) -> Iterator[tuple[KernelManager, BlockingKernelClient]]:
    """On the exec-per-cell path (a provider without managed processes): the kernel starts
    a runner client for every request, so a replaced client file is what it runs next."""
    with pytest.MonkeyPatch.context() as monkeypatch, \
            proxied_engine(engine, monkeypatch, refuse_processes=True):
        env = {**os.environ, "SANDBOX_KERNEL_OUTPUT_LIMIT": "2"}
        with running_kernel(kernelspec, env=env) as pair:
            yield pair


@pytest.fixture(scope="module")
def channel_kernel(kernelspec: str) -> Iterator[tuple[KernelManager, BlockingKernelClient]]:
    env = {**os.environ, "SANDBOX_KERNEL_OUTPUT_LIMIT": "2"}
    with running_kernel(kernelspec, env=env) as pair:
        yield pair


# Writes N MiB of 'x' into the channel's stdout, then a newline: what any code in the sandbox
# can put on the kernel's channel. The daemon writes the channel itself, on the pipe the
# relay handed it: the one write-only pipe of this process that is not fd 1 or 2's.
RELAY_FLOOD = """
import os
def channel_fd():
    def pipe(fd):
        target = os.readlink('/proc/self/fd/%d' % fd)
        return target if target.startswith('pipe:') else None
    captured = set([pipe(1), pipe(2)])
    found = []
    for name in os.listdir('/proc/self/fd'):
        fd = int(name)
        try:
            target = pipe(fd)
            flags = int(open('/proc/self/fdinfo/%d' % fd).read().split('flags:')[1].split()[0], 8)
        except OSError:
            continue
        if fd > 2 and target and target not in captured and flags & os.O_ACCMODE == os.O_WRONLY:
            found.append(fd)
    [fd] = found
    return fd
out = os.fdopen(os.dup(channel_fd()), 'wb', buffering=0)
block = b'x' * (1 << 20)
for _ in range({mib}):
    out.write(block)
out.write(b'\\n')
out.close()
print('the cell ran')
"""


def test_an_unterminated_line_on_the_channel_is_dropped(channel_kernel, engine: EngineEndpoint) -> None:
    km, kc = channel_kernel
    execute(kc, "pass")
    with memory_growth(kernel_pid(km)) as kernel_growth, memory_growth(engine.pid) as engine_growth:
        run = execute(kc, RELAY_FLOOD.format(mib=300), timeout=300)
    print(f"300 MiB line on the channel: kernel +{kernel_growth.mib:.0f} MiB, "
          f"engine +{engine_growth.mib:.0f} MiB")
    # The attack ran: the kernel saw a line too long to hold, or lost its middle to the
    # service's window (the relay's flow control does not hold back other writers) ...
    said = run.text("stderr")
    assert "[sandbox-kernel] dropped a line of" in said or "chunks of output were lost" in said
    # ... held none of it, and the cell and the next one ran.
    assert run.reply["content"]["status"] == "ok"
    assert "the cell ran\n" in run.text()
    assert kernel_growth.mib < KERNEL_BOUND_MIB
    assert engine_growth.mib < ENGINE_BOUND_MIB
    assert execute(kc, "print(6 * 7)").text() == "42\n"


def kernel_pid(km: KernelManager) -> int:
    return km.provisioner.process.pid  # type: ignore[union-attr]


def test_an_unterminated_line_is_dropped_with_one_line(kernel, engine: EngineEndpoint) -> None:
    km, kc = kernel
    install_evil_client(kc, 300)
    with memory_growth(kernel_pid(km)) as kernel_growth, memory_growth(engine.pid) as engine_growth:
        run = execute(kc, "print('the cell ran')", timeout=300)
    print(f"300 MiB unterminated line: kernel +{kernel_growth.mib:.0f} MiB, "
          f"engine +{engine_growth.mib:.0f} MiB")
    notices = [line for line in run.text("stderr").splitlines() if "dropped a line" in line]
    # The attack ran: the kernel read all 300 MiB (it counted them) ...
    assert notices == ["[sandbox-kernel] dropped a line of 300.0 MiB from the sandbox: "
                       "longer than the 3 MiB a runner event may be"]
    # ... held none of it, and the cell then ran with the real client.
    assert run.reply["content"]["status"] == "ok"
    assert run.text() == "the cell ran\n"
    assert kernel_growth.mib < KERNEL_BOUND_MIB
    assert engine_growth.mib < ENGINE_BOUND_MIB


def test_a_flood_answering_tab_is_capped(kernel, engine: EngineEndpoint) -> None:
    km, kc = kernel
    install_evil_client(kc, 600)
    with memory_growth(kernel_pid(km)) as kernel_growth, memory_growth(engine.pid) as engine_growth:
        msg_id = kc.complete("impo", 4)
        reply = kc.get_shell_msg(timeout=300)
    print(f"600 MiB answer to a completion: kernel +{kernel_growth.mib:.0f} MiB, "
          f"engine +{engine_growth.mib:.0f} MiB")
    assert reply["parent_header"]["msg_id"] == msg_id
    assert reply["content"]["status"] == "ok" and reply["content"]["matches"] == []
    assert kernel_growth.mib < BUFFERED_BOUND_MIB
    assert engine_growth.mib < BUFFERED_BOUND_MIB
    assert execute(kc, "print(6 * 7)").text() == "42\n"  # the real client is back


@pytest.fixture
async def sandbox(client: SandboxClient) -> AsyncIterator[str]:
    created = await client.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-512mb"))
    yield created.id
    await client.delete_sandbox(created.id)


async def test_buffered_exec_output_is_capped(client: SandboxClient, sandbox: str,
                                              engine: EngineEndpoint) -> None:
    flood = "import sys\nfor _ in range(600): sys.stdout.write('x' * (1 << 20))"
    with memory_growth(engine.pid) as growth:
        response = await client.exec(sandbox, "python3", ["-c", flood], timeout=300)
    print(f"buffered exec writing 600 MiB: engine +{growth.mib:.0f} MiB")
    result = response.result
    assert result.exit_code == 0  # the command ran to its end
    assert result.stdout == "x" * MAX_BUFFERED_OUTPUT
    assert result.error and "output truncated" in result.error
    assert str(600 * MIB - MAX_BUFFERED_OUTPUT) in result.error
    assert growth.mib < BUFFERED_BOUND_MIB


async def test_files_stream_through_the_engine(sandbox: str, engine: EngineEndpoint) -> None:
    made = 600 * MIB
    headers = {"X-Api-Key": engine.token}
    base = f"{engine.url}/v1/sandboxes/{sandbox}"
    async with httpx.AsyncClient(timeout=300, trust_env=False) as http:
        sparse = await http.post(f"{base}/exec", headers=headers, json={
            "cmd": "python3", "args": ["-c", f"open('/workspace/sparse', 'wb').truncate({made})"]})
        assert sparse.json()["data"]["result"]["exit_code"] == 0
        with memory_growth(engine.pid) as download:
            received = 0
            async with http.stream("GET", f"{base}/files", params={"path": "/workspace/sparse"},
                                   headers=headers) as response:
                assert response.status_code == 200
                assert response.headers["content-length"] == str(made)
                async for chunk in response.aiter_raw():
                    received += len(chunk)
        assert received == made  # the attack ran: every byte came through

        async def upload_body() -> AsyncIterator[bytes]:
            block = b"u" * MIB
            for _ in range(300):
                yield block

        with memory_growth(engine.pid) as upload:
            stored = await http.put(f"{base}/files", params={"path": "/workspace/upload"},
                                    headers=headers, content=upload_body())
        assert stored.status_code == 200 and stored.json()["data"]["bytes"] == 300 * MIB
    print(f"download of a 600 MiB sparse file: engine +{download.mib:.0f} MiB; "
          f"upload of 300 MiB: engine +{upload.mib:.0f} MiB")
    assert download.mib < ENGINE_BOUND_MIB
    assert upload.mib < ENGINE_BOUND_MIB


def tree_bytes(path: Path) -> int:
    return sum(p.lstat().st_blocks * 512 for p in path.rglob("*") if not p.is_symlink())


async def test_the_sandbox_console_is_no_host_file(client: SandboxClient, sandbox: str,
                                                   engine: EngineEndpoint, state_dir: Path) -> None:
    """bwrap's init (pid 1) and the agent hold the stdout and stderr bwrap was started with, a
    pipe the engine reads (before, a file in the engine's state dir, outside the disk cap).
    Every other process tries to open it through /proc and flood it: the open is refused
    (neither holder can be inspected), and were it not, the engine keeps only a small tail."""
    flood = ("import os, signal\n"
             "console = os.readlink('/proc/1/fd/2')\n"
             "assert console.startswith('pipe:'), console\n"
             "fds = []\n"
             "for path in ('/proc/1/fd/2', '/proc/2/fd/2'):\n"
             "    try:\n        fds.append(os.open(path, os.O_WRONLY))\n"
             "    except PermissionError:\n        pass\n"
             "if not fds:\n    print('refused', flush=True)\n    os._exit(0)\n"
             "signal.alarm(5)\nblock = b'x' * (1 << 20)\nwritten = 0\n"
             "def report(*_):\n    print(written, flush=True)\n    os._exit(0)\n"
             "signal.signal(signal.SIGALRM, report)\n"
             "while written < (500 << 20):\n    written += os.write(fds[0], block)\nreport()\n")
    host_dir = state_dir / "sandboxes" / sandbox
    before = tree_bytes(host_dir)
    with memory_growth(engine.pid) as growth:
        response = await client.exec(sandbox, "python3", ["-c", flood], timeout=60)
    outcome = response.result.stdout.strip()
    grown = tree_bytes(host_dir) - before
    print(f"5 s trying to write to the sandbox's console: {outcome}, host files "
          f"+{grown / MIB:.1f} MiB, engine +{growth.mib:.0f} MiB")
    assert response.result.exit_code == 0, response.result.stderr  # the attack ran: it saw the console pipe
    assert outcome == "refused" or int(outcome) > 0
    assert grown < MIB
    assert growth.mib < ENGINE_BOUND_MIB
