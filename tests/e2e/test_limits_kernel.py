"""The memory limit seen from a notebook: the Python killed at the limit is a kernel's death
for the frontend (tests/e2e/test_runner_death.py), and the cell says it was the memory limit,
and how much the Python held at most."""

from __future__ import annotations

import os
import re

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
    # With the most memory the Python held (its warden's record): near the limit, never above.
    peak = re.fullmatch(r"sandbox-kernel: the Python in the sandbox died \(killed at the memory limit of 256 MiB, "
                        r"its peak (\d+) MiB\); the kernel restarts in the same sandbox: variables and imports are "
                        r"gone, files are kept\n", said)
    assert peak is not None, said
    assert 128 < int(peak.group(1)) <= 256
