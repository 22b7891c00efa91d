"""The memory limit seen from a notebook: one clear line, a fresh runner, the kernel alive."""

from __future__ import annotations

import os

import pytest

from kernel_helpers import execute, running_kernel
from sandbox_kernel.local.limits import select as select_limiter

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    "memory" not in select_limiter().held_by_cgroups(), reason="no memory cgroup on this host")]


def test_a_memory_bomb_ends_the_cell_with_one_line_and_the_next_cell_works(kernelspec: str) -> None:
    env = {**os.environ, "SANDBOX_KERNEL_SHAPE": "s-1vcpu-256mb"}
    with running_kernel(kernelspec, env=env) as (_, kc):
        execute(kc, "x = 41")
        bomb = execute(kc, "hog = b'x' * (512 << 20)\nprint('survived')")
        assert bomb.reply["content"]["status"] == "error"
        said = bomb.text("stderr") + bomb.text()
        assert "survived" not in said
        assert "cell killed: memory limit 256 MiB reached" in said
        assert "restarted" in said  # and says the Python state is gone
        after = execute(kc, "print('x' in globals(), 6 * 7)")
        assert after.reply["content"]["status"] == "ok"
        assert after.text() == "False 42\n"
        assert "reached" not in execute(kc, "print(1)").text("stderr")  # said once, not again
        [status] = execute(kc, "%sandbox status").of_type("display_data")
        assert "\nlimits       memory 256 MiB (cgroup v" in status["data"]["text/plain"]
