"""The kernel's channel to its runner, end to end: output produced between cells (a
background thread, a subprocess) reaches the frontend on the parent of the cell that
started it, as under ipykernel; requests and cells keep working around it."""

from __future__ import annotations

import asyncio
import queue
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.blocking.client import BlockingKernelClient

from kernel_helpers import RELAYS, execute, running_kernel
from sandbox_kernel.sandbox import runner_setup
from sandbox_kernel.sandbox import session as session_module
from sandbox_kernel.api import CreateSandboxRequest, SandboxClient
from sandbox_kernel.config import Settings
from sandbox_kernel.guest import bundle
from sandbox_kernel.local.service import EngineEndpoint

pytestmark = pytest.mark.slow

LATER = """
import subprocess, threading, time
def later():
    time.sleep(0.5)
    print('from the thread', flush=True)
threading.Thread(target=later).start()
subprocess.Popen(['sh', '-c', 'sleep 0.7; echo from the subprocess'])
"""


def outputs_until(kc: BlockingKernelClient, texts: set[str], timeout: float = 30) -> list[dict[str, Any]]:
    """iopub stream messages, until every text in `texts` has been seen."""
    seen: list[dict[str, Any]] = []
    while not texts <= {m["content"]["text"] for m in seen}:
        try:
            message = kc.get_iopub_msg(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"never arrived: {texts - {m['content']['text'] for m in seen}}")
        if message["msg_type"] == "stream":
            seen.append(message)
    return seen


def test_output_between_cells_arrives_on_the_parent_of_the_cell_that_started_it(kernelspec: str) -> None:
    with running_kernel(kernelspec) as (_, kc):
        started = execute(kc, LATER)
        assert started.reply["content"]["status"] == "ok"
        assert started.text() == "", "the thread and the subprocess print after the cell"
        seen = outputs_until(kc, {"from the thread\n", "from the subprocess\n"})
        parents = {m["parent_header"]["msg_id"] for m in seen}
        assert parents == {started.reply["parent_header"]["msg_id"]}
        assert {m["content"]["name"] for m in seen} == {"stdout"}
        # Cells, completion and the counter carry on as before.
        assert execute(kc, "print(6 * 7)").text() == "42\n"
        assert "threading" in kc.complete("thre", 4, reply=True, timeout=60)["content"]["matches"]


def test_a_relay_killed_from_a_cell_is_replaced_and_the_runner_kept(kernelspec: str) -> None:
    with running_kernel(kernelspec) as (_, kc):
        assert execute(kc, RELAYS + "x = 41\nprint(len(relays()))").text() == "1\n"
        killed = execute(kc, "old = relays()\nfor pid in old:\n    os.kill(pid, signal.SIGKILL)\n"
                             "while set(old) & set(relays()):\n    time.sleep(0.01)\n"
                             "print('killed', len(old), flush=True)\ntime.sleep(0.5)\nprint('after', x + 1)")
        assert killed.reply["content"]["status"] == "ok", killed.text("stderr")
        assert killed.text() == "killed 1\nafter 42\n", "the cell's output after the kill came through a new relay"
        now = execute(kc, "new = relays()\nprint(len(new), set(new) & set(old), x)")
        assert now.text() == "1 set() 41\n", "one new relay; the runner and its variables are the same"


def test_output_of_a_thread_during_the_next_cell_belongs_to_that_cell(kernelspec: str) -> None:
    with running_kernel(kernelspec) as (_, kc):
        execute(kc, "import threading, time\n"
                    "go = threading.Event()\n"
                    "threading.Thread(target=lambda: (go.wait(), print('during', flush=True))).start()")
        during = execute(kc, "go.set(); time.sleep(0.5)")
        assert during.text() == "during\n"


def unusable_sandbox(engine: EngineEndpoint) -> str:
    """A sandbox where no runner can start: its runner directory is taken by a file."""
    async def make() -> str:
        async with SandboxClient(engine.url, engine.token) as client:
            created = await client.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-512mb"))
            await client.exec(created.id, "sh", ["-c", "touch /tmp/sandbox-kernel"])
            return created.id

    return asyncio.run(make())


def test_a_magic_that_raises_still_gets_its_reply(kernelspec: str, engine: EngineEndpoint) -> None:
    """`%sandbox attach --fresh` to a sandbox where the runner cannot start raises inside the
    session (not a SessionError): the cell still gets an execute_reply and one line."""
    target = unusable_sandbox(engine)
    with running_kernel(kernelspec) as (_, kc):
        execute(kc, "x = 'kept'")
        failed = execute(kc, f"%sandbox attach --fresh {target}")
        assert failed.reply["content"]["status"] == "error"
        [line] = failed.text("stderr").splitlines()
        assert line.startswith("sandbox-kernel: ") and "mkdir" in line
        # The notebook stays on its sandbox, its variables intact.
        assert execute(kc, "print(x)").text() == "kept\n"


async def test_a_runner_that_dies_at_start_is_said_with_its_last_words(
        engine: EngineEndpoint, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The exec that starts the runner also waits for it (one round trip): a runner that
    exits at once is reported by that exec, with the end of its log."""
    broken = tmp_path / "__main__.py"
    broken.write_text("import sys\nsys.exit('this runner stops at once')\n")
    monkeypatch.setitem(runner_setup.RUNNER_FILES, f"{bundle.PACKAGE}/{bundle.RUNNER}/__main__.py", broken)
    session = session_module.SandboxSession(Settings.from_env())
    try:
        with pytest.raises(session_module.SessionError, match="did not start: this runner stops at once"):
            await session.start()
    finally:
        await session.shutdown()
