"""The memory limit seen from a notebook: the Python killed at the limit is a kernel's death
for the frontend (tests/e2e/test_runner_death.py), and the cell says it was the memory limit."""

from __future__ import annotations

import os

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import DeadKernelError

from kernel_helpers import TIMEOUT
from sandbox_kernel.local.limits import select as select_limiter

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    "memory" not in select_limiter().held_by_cgroups(), reason="no memory cgroup on this host")]


def test_a_memory_bomb_is_a_dead_kernel_whose_cell_names_the_memory_limit(kernelspec: str) -> None:
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("%sandbox status"),
        nbformat.v4.new_code_cell("hog = b'x' * (512 << 20)\nprint('survived')"),
    ])
    with pytest.raises(DeadKernelError):
        NotebookClient(nb, kernel_name=kernelspec, timeout=TIMEOUT).execute(
            env={**os.environ, "SANDBOX_KERNEL_SHAPE": "s-1vcpu-256mb"})
    [status] = [output for output in nb.cells[0].outputs if output["output_type"] == "display_data"]
    assert "\nlimits       memory 256 MiB (cgroup v" in status["data"]["text/plain"]
    said = "".join(output.get("text", "") for output in nb.cells[1].outputs)
    assert said == ("sandbox-kernel: the Python in the sandbox died (killed at the memory limit of 256 MiB); "
                    "the kernel restarts in the same sandbox: variables and imports are gone, files are kept\n")
