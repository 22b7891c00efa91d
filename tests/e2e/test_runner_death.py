"""When the notebook's Python (the runner in the sandbox) dies, frontends learn that the state
is gone as they do when ipykernel's Python dies: the kernel process ends (nbclient raises
DeadKernelError; JupyterLab's restarter starts the kernel again), after saying in the cell
why the Python died, whether it died in a cell or between cells (a background thread's
os._exit: the kernel ends at once, its line on the last cell). The restarted kernel drives
the same sandbox with a fresh Python: the files are kept; with no restarter, the shutdown
policy holds. (The memory limit's cause: tests/e2e/test_limits_kernel.py.)
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import re
import time
from collections.abc import Iterator
from typing import Any

import nbformat
import pytest
from jupyter_client import BlockingKernelClient, KernelManager
from jupyter_client.ioloop import AsyncIOLoopKernelManager
from nbclient import NotebookClient
from nbclient.exceptions import DeadKernelError

from cli_helpers import cli
from engine_helpers import sandbox_status
from fault_proxy import proxied_engine
from kernel_helpers import TIMEOUT, execute
from message_spec import validate
from sandbox_kernel.api import SandboxStatus
from sandbox_kernel.local.service import EngineEndpoint

pytestmark = [pytest.mark.slow, pytest.mark.kernel]

KILL_ITSELF = "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)"
WRITE_AND_NAME = ("import os\nopen('/workspace/kept.txt', 'w').write('still here')\n"
                  "state = 'lost'\nprint(os.environ['SANDBOX_ID'])")
SAID_SIGKILL = ("sandbox-kernel: the Python in the sandbox died (killed by SIGKILL); the kernel restarts in "
                "the same sandbox: variables and imports are gone, files are kept\n")
SAID_EXIT_3 = ("sandbox-kernel: the Python in the sandbox died (exit code 3); the kernel restarts in "
               "the same sandbox: variables and imports are gone, files are kept\n")
# A thread that ends the Python once its cell is over (the cell's frames have left the main
# thread, and its reply has had half a second to go): a death between cells.
DIE_AFTER_THE_CELL = """
import os, sys, threading, time
def _die_after(cell_file, main=threading.main_thread().ident):
    def running():
        frame = sys._current_frames().get(main)
        while frame is not None:
            if frame.f_code.co_filename == cell_file:
                return True
            frame = frame.f_back
        return False
    while running():
        time.sleep(0.05)
    time.sleep(0.5)
    os._exit(3)
threading.Thread(target=_die_after, args=(sys._getframe().f_code.co_filename,), daemon=True).start()
"""


@contextlib.contextmanager
def kernel_that_may_die(kernelspec: str, **start: Any) -> Iterator[tuple[KernelManager, BlockingKernelClient]]:
    """A ready kernel driven by hand (no restarter), shut down after the test whether its
    process is still alive or not; start_kernel's arguments as `start`."""
    km = KernelManager(kernel_name=kernelspec)
    km.start_kernel(**start)
    try:
        kc = km.client()
        kc.start_channels()
        kc.wait_for_ready(timeout=TIMEOUT)
        yield km, kc
        kc.stop_channels()
    finally:
        km.shutdown_kernel(now=True)


def ended(km: KernelManager) -> bool:
    """Whether the kernel process ends on its own (within TIMEOUT)."""
    deadline = time.monotonic() + TIMEOUT
    while km.is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    return not km.is_alive()


def test_nbclient_sees_a_dead_kernel_and_the_cell_says_why(kernelspec: str) -> None:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(KILL_ITSELF),
                                         nbformat.v4.new_code_cell("print('never run')")])
    with pytest.raises(DeadKernelError):
        NotebookClient(nb, kernel_name=kernelspec, timeout=TIMEOUT).execute()
    assert "".join(output.get("text", "") for output in nb.cells[0].outputs) == SAID_SIGKILL
    assert nb.cells[1].outputs == []


# A cell may interrupt its whole process group, which holds the runner's warden too.
INTERRUPT_MY_GROUP = ("import os, signal, time\ntry:\n    os.killpg(0, signal.SIGINT)\n    time.sleep(5)\n"
                      "except KeyboardInterrupt:\n    print('interrupted')")


def test_a_death_after_a_cell_interrupted_its_process_group_is_said_with_its_cause(kernelspec: str) -> None:
    """The runner's warden is in the group the cell interrupted: it waits on for the Python
    all the same, so that a later death is said with its cause, from the warden's record."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(INTERRUPT_MY_GROUP),
                                         nbformat.v4.new_code_cell(KILL_ITSELF)])
    with pytest.raises(DeadKernelError):
        NotebookClient(nb, kernel_name=kernelspec, timeout=TIMEOUT).execute()
    assert "".join(output.get("text", "") for output in nb.cells[0].outputs) == "interrupted\n"
    assert "".join(output.get("text", "") for output in nb.cells[1].outputs) == SAID_SIGKILL


def test_a_restarted_kernel_drives_the_same_sandbox_with_a_fresh_python(kernelspec: str) -> None:
    with kernel_that_may_die(kernelspec) as (km, kc):
        sandbox_id = execute(kc, WRITE_AND_NAME).text().strip()
        kc.execute(KILL_ITSELF)
        assert ended(km)
        kc.stop_channels()
        # What a server's restarter does once it sees the process dead (JupyterLab's).
        km.restart_kernel(now=True)
        kc = km.client()
        kc.start_channels()
        kc.wait_for_ready(timeout=TIMEOUT)
        after = execute(kc, "import os\nprint(os.environ['SANDBOX_ID'], open('/workspace/kept.txt').read(),"
                            " 'state' in globals())")
        assert after.reply["content"]["status"] == "ok", after.text("stderr")
        assert after.text() == f"{sandbox_id} still here False\n"
        assert after.reply["content"]["execution_count"] == 1  # a new kernel's count
        kc.stop_channels()


def iopub_left(kc: Any) -> list[dict[str, Any]]:
    """The IOPub messages a frontend received and had not read yet (all validated)."""
    messages = []
    while True:
        try:
            msg = kc.get_iopub_msg(timeout=1)
        except queue.Empty:
            return messages
        validate(msg)
        messages.append(msg)


def test_a_python_that_dies_between_cells_ends_the_kernel_without_a_next_cell(kernelspec: str) -> None:
    with kernel_that_may_die(kernelspec) as (km, kc):
        armed = execute(kc, "print('armed')" + DIE_AFTER_THE_CELL)
        assert armed.reply["content"]["status"] == "ok", armed.text("stderr")
        assert armed.text() == "armed\n"
        assert ended(km)  # no other request was sent
        said = [msg for msg in iopub_left(kc) if msg["msg_type"] == "stream"]
        assert [(msg["content"]["name"], msg["content"]["text"]) for msg in said] == [("stderr", SAID_EXIT_3)]
        assert said[0]["parent_header"]["msg_id"] == armed.reply["parent_header"]["msg_id"]  # the last cell


def test_a_sandbox_destroyed_between_cells_is_said_by_the_next_cell_and_the_kernel_lives(kernelspec: str) -> None:
    """Someone else destroys the notebook's sandbox (`sandbox-kernel rm`, the provider's
    console) while no cell runs. No Python can start there again, so the kernel does not end
    to be restarted into it: it lives, and the next cell says in one line that it is gone."""
    with kernel_that_may_die(kernelspec) as (km, kc):
        sandbox_id = execute(kc, "import os\nprint(os.environ['SANDBOX_ID'])").text().strip()
        removed = cli("rm", sandbox_id)
        assert removed.returncode == 0, removed.stderr
        failed = execute(kc, "print('never run')")
        assert failed.reply["content"]["status"] == "error" and failed.text() == ""
        assert re.search(f"the sandbox {sandbox_id} is (destroying|destroyed): its Python and its files are gone",
                         failed.reply["content"]["evalue"]), failed.reply["content"]["evalue"]
        assert km.is_alive()


def test_without_a_channel_a_death_between_cells_is_found_by_the_next_cell(
        kernelspec: str, engine: EngineEndpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """A provider without managed processes (one exec per cell): nothing follows the Python
    between cells, so its death is found by the next cell, which says it as for a death in a cell."""
    with proxied_engine(engine, monkeypatch, refuse_processes=True), kernel_that_may_die(kernelspec) as (km, kc):
        armed = execute(kc, "print('armed')" + DIE_AFTER_THE_CELL)
        assert armed.reply["content"]["status"] == "ok", armed.text("stderr")
        time.sleep(3)  # the Python ends meanwhile (half a second after its cell)
        assert km.is_alive()
        next_cell = kc.execute("print('never run')")
        assert ended(km)
        said = [msg for msg in iopub_left(kc) if msg["msg_type"] == "stream"]
        assert [(msg["content"]["name"], msg["content"]["text"]) for msg in said] == [("stderr", SAID_EXIT_3)]
        assert said[0]["parent_header"]["msg_id"] == next_cell


def test_an_auto_restarter_restarts_a_kernel_whose_python_died_into_the_same_sandbox(kernelspec: str) -> None:
    """As JupyterLab runs kernels: an AsyncIOLoopKernelManager with its restarter."""
    asyncio.run(_restarted_by_the_restarter(kernelspec))


async def _restarted_by_the_restarter(kernelspec: str) -> None:
    km = AsyncIOLoopKernelManager(kernel_name=kernelspec)
    await km.start_kernel()
    restarts = asyncio.Event()
    km.add_restart_callback(restarts.set, "restart")
    km.start_restarter()
    try:
        kc = km.client()
        kc.start_channels()
        await kc.wait_for_ready(timeout=TIMEOUT)
        outputs: list[dict[str, Any]] = []
        reply = await kc.execute_interactive(WRITE_AND_NAME + DIE_AFTER_THE_CELL, output_hook=outputs.append,
                                             timeout=TIMEOUT)
        assert reply["content"]["status"] == "ok"
        [sandbox_id] = [msg["content"]["text"].strip() for msg in outputs
                        if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout"]
        await asyncio.wait_for(restarts.wait(), TIMEOUT)  # the restarter saw the process end
        kc.stop_channels()
        deadline = time.monotonic() + TIMEOUT
        while not await km.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        kc = km.client()
        kc.start_channels()
        await kc.wait_for_ready(timeout=TIMEOUT)
        outputs = []
        reply = await kc.execute_interactive(
            "import os\nprint(os.environ['SANDBOX_ID'], open('/workspace/kept.txt').read(), 'state' in globals())",
            output_hook=outputs.append, timeout=TIMEOUT)
        assert reply["content"]["status"] == "ok", outputs
        assert [msg["content"]["text"] for msg in outputs if msg["msg_type"] == "stream"] == [
            f"{sandbox_id} still here False\n"]
        kc.stop_channels()
    finally:
        km.stop_restarter()
        await km.shutdown_kernel(now=True)


def test_a_kernel_that_dies_with_nobody_to_restart_it_leaves_its_sandbox_as_its_policy_says(
        kernelspec: str, engine: EngineEndpoint) -> None:
    sandbox_id = ""
    try:
        with kernel_that_may_die(kernelspec, env={**os.environ, "SANDBOX_KERNEL_ON_SHUTDOWN": "keep"}) as (km, kc):
            sandbox_id = execute(kc, WRITE_AND_NAME).text().strip()
            kc.execute(KILL_ITSELF)
            assert ended(km)
            # Nobody restarts it: the sandbox is kept, as `on_shutdown keep` asked, for `ls` and `gc` alike.
            [listed] = [line for line in cli("ls").stdout.splitlines() if line.startswith(sandbox_id)]
            assert listed.endswith("owner: kept"), listed
            assert sandbox_id not in cli("gc", "--dry-run").stdout
            assert sandbox_status(engine, sandbox_id) == SandboxStatus.RUNNING
    finally:
        if sandbox_id:
            cli("rm", sandbox_id)
