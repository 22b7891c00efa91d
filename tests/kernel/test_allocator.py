"""The kernel's malloc settings: a long output's buffers reuse memory instead of faulting in
fresh pages for each (sandbox_kernel/allocator.py)."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest
from jupyter_client import BlockingKernelClient, KernelManager

from kernel_helpers import execute

pytestmark = [pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's"),
              pytest.mark.one_path]

# Buffers of a long print's sizes, several alive at once, then freed, over and over: the
# page faults of the repetitions (after a first round that may fault in the heap).
CHURN = """
import resource, sys
if sys.argv[1] == "tuned":
    from sandbox_kernel.kernel.allocator import reuse_large_buffers
    assert reuse_large_buffers()

def churn():
    buffers = [b"x" * (1536 * 1024) for _ in range(4)]
    del buffers

churn()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(40):
    churn()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
PAGES_WRITTEN = 40 * 4 * 1536 * 1024 // 4096


def _faults(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", CHURN, mode], capture_output=True, text=True, check=True)
    return int(done.stdout)


def test_freed_buffers_are_reused_not_faulted_in_again() -> None:
    # Without the settings glibc gives most of the pages back and faults them in again (so
    # the churn does measure it); with them, almost none of the pages written is new.
    assert _faults("default") > PAGES_WRITTEN // 2
    assert _faults("tuned") < PAGES_WRITTEN // 100


def test_a_long_print_faults_in_few_pages_of_the_kernel(
        kernel: tuple[KernelManager, BlockingKernelClient]) -> None:
    # The kernel's main() applies the settings: an 8 MiB print (after one that warms the
    # heap up) moves ~11 MiB of frames and messages through the kernel, each freed soon
    # after. Without the settings it faulted in 7,560 pages in one run; with them 11 to 544
    # in eight runs (the heaps of the kernel's other threads vary). The bound is half the
    # pages of the text itself.
    km, kc = kernel
    flood = "import sys\nfor _ in range(8 * 1024): sys.stdout.write('x' * 1023 + '\\n')"
    assert execute(kc, flood).reply["content"]["status"] == "ok"
    before = _minor_faults(km.provisioner.process.pid)
    run = execute(kc, flood)
    faults = _minor_faults(km.provisioner.process.pid) - before
    assert len(run.text()) == 8 * 2**20
    assert faults < 8 * 2**20 // 4096 // 2


def _minor_faults(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[7])  # minflt, the 10th field of proc(5)'s stat
