"""Kernel start, restart and shutdown, as the sandbox sees them."""

from __future__ import annotations

import pytest
from jupyter_client.manager import start_new_kernel

from engine_helpers import sandbox_status
from kernel_helpers import PROVIDER, TIMEOUT, execute
from sandbox_kernel.api import SandboxStatus
from sandbox_kernel.local.service import EngineEndpoint

pytestmark = pytest.mark.slow


def test_restart_is_a_fresh_runner_in_the_same_sandbox(kernelspec: str, engine: EngineEndpoint) -> None:
    km, kc = start_new_kernel(kernel_name=kernelspec, startup_timeout=TIMEOUT)
    try:
        before = execute(kc, "import os\nopen('kept.txt', 'w').write('x')\nx = 1\nprint(os.environ['SANDBOX_ID'])")
        sandbox_id = before.text().strip()
        km.restart_kernel()
        kc.wait_for_ready(timeout=TIMEOUT)
        after = execute(kc, "import os\nprint(os.environ['SANDBOX_ID'], os.path.exists('kept.txt'), 'x' in globals())")
        assert after.text() == f"{sandbox_id} True False\n"
        assert after.reply["content"]["execution_count"] == 1
    finally:
        kc.stop_channels()
        km.shutdown_kernel()
    assert sandbox_status(engine, sandbox_id) in (SandboxStatus.DESTROYED, None)


def test_shutdown_destroys_the_sandbox(kernelspec: str, engine: EngineEndpoint) -> None:
    km, kc = start_new_kernel(kernel_name=kernelspec, startup_timeout=TIMEOUT)
    sandbox_id = execute(kc, "import os; print(os.environ['SANDBOX_ID'])").text().strip()
    assert sandbox_status(engine, sandbox_id) == SandboxStatus.RUNNING
    kc.stop_channels()
    km.shutdown_kernel()
    assert sandbox_status(engine, sandbox_id) in (SandboxStatus.DESTROYED, None)


def test_failed_sandbox_start_is_one_line_and_the_kernel_lives(kernelspec: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDBOX_KERNEL_SHAPE", "s-64vcpu-1tb")
    km, kc = start_new_kernel(kernel_name=kernelspec, startup_timeout=TIMEOUT)
    try:
        for _ in range(2):
            result = execute(kc, "print('never runs')")
            assert result.reply["content"]["status"] == "error"
            lines = result.text("stderr").splitlines()
            assert len(lines) == 1
            assert lines[0].startswith(f"sandbox-kernel: could not start a sandbox on {PROVIDER}")
            assert "s-64vcpu-1tb" in lines[0]
            assert result.text() == ""
        assert km.is_alive()
        assert kc.kernel_info(reply=True, timeout=TIMEOUT)["content"]["status"] == "ok"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_config_file_and_kernel_arguments_choose_the_sandbox(
        kernelspec: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "config.toml"
    config.write_text('shape = "s-1vcpu-256mb"\nrootfs = "no-such-rootfs:1"\n')
    monkeypatch.setenv("SANDBOX_KERNEL_CONFIG", str(config))
    # The file's rootfs is refused by the service, in one line that names it.
    km, kc = start_new_kernel(kernel_name=kernelspec, startup_timeout=TIMEOUT)
    try:
        lines = execute(kc, "1").text("stderr").splitlines()
        assert len(lines) == 1 and "no-such-rootfs:1" in lines[0]
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    # A kernel argument wins over the file; the file's shape still applies.
    km, kc = start_new_kernel(kernel_name=kernelspec, startup_timeout=TIMEOUT,
                              extra_arguments=["--SandboxKernel.rootfs=host-python"])
    try:
        [status] = execute(kc, "%sandbox status").of_type("display_data")
        assert "s-1vcpu-256mb (1 vCPU, 256 MiB)" in status["data"]["text/plain"]
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
