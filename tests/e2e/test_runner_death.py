"""When the notebook's Python (the runner in the sandbox) dies, frontends learn that the state
is gone as they do when ipykernel's Python dies: the kernel process ends (nbclient raises
DeadKernelError; JupyterLab's restarter starts the kernel again), after saying in the cell
why the Python died. The restarted kernel drives the same sandbox with a fresh Python: the
files are kept. (The memory limit's cause: tests/e2e/test_limits_kernel.py.)
"""

from __future__ import annotations

import time

import nbformat
import pytest
from jupyter_client import KernelManager
from nbclient import NotebookClient
from nbclient.exceptions import DeadKernelError

from kernel_helpers import TIMEOUT, execute

pytestmark = [pytest.mark.slow, pytest.mark.kernel]

KILL_ITSELF = "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)"
WRITE_AND_NAME = ("import os\nopen('/workspace/kept.txt', 'w').write('still here')\n"
                  "state = 'lost'\nprint(os.environ['SANDBOX_ID'])")
SAID_SIGKILL = ("sandbox-kernel: the Python in the sandbox died (killed by SIGKILL); the kernel restarts in "
                "the same sandbox: variables and imports are gone, files are kept\n")


def test_nbclient_sees_a_dead_kernel_and_the_cell_says_why(kernelspec: str) -> None:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(KILL_ITSELF),
                                         nbformat.v4.new_code_cell("print('never run')")])
    with pytest.raises(DeadKernelError):
        NotebookClient(nb, kernel_name=kernelspec, timeout=TIMEOUT).execute()
    assert "".join(output.get("text", "") for output in nb.cells[0].outputs) == SAID_SIGKILL
    assert nb.cells[1].outputs == []


def test_a_restarted_kernel_drives_the_same_sandbox_with_a_fresh_python(kernelspec: str) -> None:
    km = KernelManager(kernel_name=kernelspec)
    km.start_kernel()
    try:
        kc = km.client()
        kc.start_channels()
        kc.wait_for_ready(timeout=TIMEOUT)
        before = execute(kc, WRITE_AND_NAME)
        sandbox_id = before.text().strip()
        kc.execute(KILL_ITSELF)
        deadline = time.monotonic() + TIMEOUT
        while km.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not km.is_alive()
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
    finally:
        km.shutdown_kernel(now=True)
