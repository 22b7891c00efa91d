"""The runner's info is the sandbox's word: a kernel attaching takes nothing but a runner's
info (a JSON object) for a runner it can drive. Real engine, real kernels."""

from __future__ import annotations

import json

import pytest

from kernel_helpers import execute, running_kernel
from sandbox_kernel.sandbox.runner_setup import RUNNER_CLIENT_PATH

FORGED = json.dumps(["python_version"])
FORGED_CLIENT = f"print({FORGED!r})\n"
# The cell replaces the runner's light client, through which an attaching kernel asks the
# runner for its info, by one that answers a JSON list; then runs it, to prove it is in place.
REPLACE_CLIENT = f"""
import subprocess, sys
with open({RUNNER_CLIENT_PATH!r}, "w") as file:
    file.write({FORGED_CLIENT!r})
print(subprocess.run([sys.executable, "-I", "-S", {RUNNER_CLIENT_PATH!r}, "request", "e30="],
                     capture_output=True, text=True).stdout, end="")
"""
SANDBOX_ID = "import os\nprint(os.environ['SANDBOX_ID'])"


@pytest.mark.slow
def test_a_forged_info_answer_is_no_runner_to_keep(kernelspec: str) -> None:
    with running_kernel(kernelspec) as (_, attacker):
        sandbox = execute(attacker, SANDBOX_ID).text().strip()
        execute(attacker, "x = 1")
        replaced = execute(attacker, REPLACE_CLIENT)
        assert replaced.text() == FORGED + "\n", replaced.reply["content"]  # the attack is in place
        with running_kernel(kernelspec) as (_, kc):
            attached = execute(kc, f"%sandbox attach {sandbox}")
            assert attached.reply["content"]["status"] == "ok", attached.text("stderr")
            # A new runner (and its client) of this kernel's, in that sandbox: cells run there.
            assert execute(kc, SANDBOX_ID).text().strip() == sandbox
            assert execute(kc, "x").reply["content"]["ename"] == "NameError"
            assert execute(kc, "print('here')").text() == "here\n"
