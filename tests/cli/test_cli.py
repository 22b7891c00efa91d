"""The command line: kernelspec variants, ls/rm against the engine, doctor."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import pytest
from jupyter_client.manager import start_new_kernel

from cli_helpers import cli
from engine_helpers import sandbox_status
from kernel_helpers import PROVIDER, TIMEOUT, execute, running_kernel
from sandbox_kernel.api import CreateSandboxRequest, SandboxClient, SandboxStatus
from sandbox_kernel.local.service import EngineEndpoint


def test_install_a_createos_variant_without_the_key(tmp_path: Path) -> None:
    done = cli("install", "--prefix", str(tmp_path), "--provider", "createos", "--shape", "s-2vcpu-4gb",
               "--egress", "index.example.com,files.example.com:443", CREATEOS_SANDBOX_API_KEY="sk_never_written")
    assert done.returncode == 0, done.stderr
    spec_file = tmp_path / "share" / "jupyter" / "kernels" / "sandbox-createos" / "kernel.json"
    spec = json.loads(spec_file.read_text())
    assert spec["display_name"] == "Python (CreateOS sandbox, s-2vcpu-4gb)"
    assert spec["env"] == {"SANDBOX_KERNEL_PROVIDER": "createos", "SANDBOX_KERNEL_SHAPE": "s-2vcpu-4gb",
                           "SANDBOX_KERNEL_EGRESS": "index.example.com,files.example.com:443"}
    assert spec["interrupt_mode"] == "message" and spec["argv"][0] == sys.executable
    assert "sk_never_written" not in spec_file.read_text() + done.stdout + done.stderr


def test_install_refuses_bad_values_in_one_line(tmp_path: Path) -> None:
    done = cli("install", "--prefix", str(tmp_path), "--egress", "10.0.0.0/33")
    assert done.returncode == 1
    assert done.stderr.startswith("sandbox-kernel: --egress: invalid egress rule '10.0.0.0/33': bad CIDR")
    assert done.stderr.count("\n") == 1
    assert not (tmp_path / "share").exists()


@pytest.mark.parametrize("via", ["local engine", "CreateOS code path"])
def test_ls_and_rm_against_the_engine(engine: EngineEndpoint, via: str) -> None:
    # The CreateOS code path: base URL and key, as for the cloud (gc is tested both ways
    # with the kernel tests).
    env = ({"CREATEOS_SANDBOX_BASE_URL": engine.url, "CREATEOS_SANDBOX_API_KEY": engine.token}
           if via == "CreateOS code path" else {})

    async def create() -> str:
        async with SandboxClient(engine.url, engine.token) as client:
            return (await client.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-256mb", name="cli-test"))).id

    sandbox_id = asyncio.run(create())
    listed = cli("ls", **env)
    assert listed.returncode == 0, listed.stderr
    assert any(line.startswith(sandbox_id) and "cli-test" in line for line in listed.stdout.splitlines())
    removed = cli("rm", sandbox_id, **env)
    assert removed.stdout == f"{sandbox_id}: destroyed\n"
    assert sandbox_status(engine, sandbox_id) == SandboxStatus.DESTROYED
    missing = cli("rm", "sb-no-such", **env)
    assert missing.returncode == 1 and missing.stderr.startswith("sandbox-kernel: sandbox not found")


def test_doctor_says_what_holds(engine: EngineEndpoint) -> None:
    done = cli("doctor")
    assert done.returncode == 0, done.stdout
    for expected in ("✓ namespaces: user, pid, net, ipc, uts, mount", "✓ pause:", "✓ fork:",
                     "✓ network: loopback only", "limits (s-1vcpu-1gb): memory 1024 MiB (",
                     "engine of this environment: running",
                     # the test extras bring the tour's (examples), on both sides
                     "✓ jupyterlab_widgets ", "✓ jupyter-resource-usage ",
                     f"sandboxes see the Python environment {os.path.realpath(sys.prefix)} (this one, read-only)",
                     "✓ ipywidgets ", "✓ tqdm ", "✓ debugpy "):
        assert expected in done.stdout, done.stdout


def test_gc_destroys_only_what_a_dead_kernel_left(kernelspec: str, engine: EngineEndpoint) -> None:
    with running_kernel(kernelspec) as (_, alive):
        kept = execute(alive, "import os\nprint(os.environ['SANDBOX_ID'])").text().strip()
        km, kc = start_new_kernel(kernel_name=kernelspec, startup_timeout=TIMEOUT)
        left = execute(kc, "import os\nprint(os.environ['SANDBOX_ID'])").text().strip()
        kc.stop_channels()
        os.kill(km.provisioner.process.pid, signal.SIGKILL)  # a crash: no shutdown, no cleanup
        km.provisioner.process.wait(10)
        km.cleanup_resources()
        assert sandbox_status(engine, left) == SandboxStatus.RUNNING
        dry = cli("gc", "--dry-run")
        assert dry.stdout == f"{left}: orphaned (its kernel is gone); would destroy\n"
        assert sandbox_status(engine, left) == SandboxStatus.RUNNING
        collected = cli("gc")
        assert collected.stdout == f"{left}: orphaned, destroyed\n"
        assert sandbox_status(engine, left) == SandboxStatus.DESTROYED
        assert sandbox_status(engine, kept) == SandboxStatus.RUNNING  # its kernel still runs
        assert cli("gc").stdout == f"no orphaned sandboxes on {PROVIDER}\n"
