"""The sandbox made while the kernel process still imports ipykernel (early_start.py): taken
over by the kernel's session when the settings agree, destroyed when they do not, and not
begun at all where the kernel would not create a plain new sandbox."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest
from jupyter_client.manager import start_new_kernel

from kernel_helpers import TIMEOUT, execute
from sandbox_kernel.sandbox import early_start
from sandbox_kernel.api import SandboxClient, SandboxStatus
from sandbox_kernel.config import Settings
from sandbox_kernel.local.service import EngineEndpoint
from sandbox_kernel.paths import handoff_path
from sandbox_kernel.sandbox.session import SandboxSession, SessionError

pytestmark = pytest.mark.slow

SMALL_SHAPE = "s-1vcpu-256mb"


async def _statuses(engine: EngineEndpoint) -> dict[str, SandboxStatus]:
    async with SandboxClient(engine.url, engine.token) as client:
        views = [*await client.list_sandboxes(), *await client.list_sandboxes(SandboxStatus.DESTROYED.value)]
        return {view.id: view.status for view in views}


async def _output(session: SandboxSession, code: str) -> str:
    texts: list[str] = []

    async def collect(event: dict) -> None:
        if event.get("type") == "stream":
            texts.append(event.get("text", ""))
    await session.run_cell("early-start-cell", code, collect)
    return "".join(texts)


@pytest.mark.parametrize("argv", [
    ["--SandboxKernel.shape=s-1vcpu-256mb", "-f", "kernel-1.json"],  # kernel arguments decide
    ["--IPKernelApp.log_level=DEBUG"],  # no connection file: a restart could not be told
])
def test_no_early_start_where_the_command_line_decides(argv: list[str], tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDBOX_KERNEL_STATE_DIR", str(tmp_path))
    early_start.begin(argv)
    assert early_start.take() is None


def test_no_early_start_for_a_restarted_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A restart's successor takes its predecessor's sandbox (its hand-off file is there)."""
    monkeypatch.setenv("SANDBOX_KERNEL_STATE_DIR", str(tmp_path))
    connection_file = str(tmp_path / "kernel-1.json")
    path = handoff_path(connection_file)
    path.parent.mkdir()
    path.write_text("{}")
    early_start.begin(["-f", connection_file])
    assert early_start.take() is None


async def test_the_session_drives_the_sandbox_made_early(engine: EngineEndpoint) -> None:
    early = early_start.EarlyStart(Settings.from_env())
    prepared = await early.prepared()
    session = SandboxSession(Settings.from_env())
    try:
        await session.start(early=early)
        assert session.sandbox_id == prepared.sandbox_id
        assert session.runner_info["python_version"]
        assert await _output(session, "import os; print(os.environ['SANDBOX_ID'])") == f"{prepared.sandbox_id}\n"
    finally:
        await session.shutdown()
    assert (await _statuses(engine)).get(prepared.sandbox_id) in (SandboxStatus.DESTROYED, None)


async def test_a_sandbox_made_for_other_settings_is_destroyed(engine: EngineEndpoint) -> None:
    early = early_start.EarlyStart(Settings.from_env())
    prepared = await early.prepared()
    session = SandboxSession(replace(Settings.from_env(), shape=SMALL_SHAPE))
    try:
        await session.start(early=early)
        assert session.sandbox_id != prepared.sandbox_id
        assert (await session.view()).shape == SMALL_SHAPE
        assert (await _statuses(engine)).get(prepared.sandbox_id) in (SandboxStatus.DESTROYED, None)
    finally:
        await session.shutdown()


async def test_a_failed_early_start_for_other_settings_is_not_the_kernels_failure(engine: EngineEndpoint) -> None:
    early = early_start.EarlyStart(replace(Settings.from_env(), shape="s-64vcpu-1tb"))  # refused by the engine
    with pytest.raises(SessionError, match="s-64vcpu-1tb"):
        await early.prepared()
    session = SandboxSession(Settings.from_env())
    try:
        await session.start(early=early)
        assert await _output(session, "print(6 * 7)") == "42\n"
    finally:
        await session.shutdown()


def test_a_kernel_argument_from_a_jupyter_config_file_is_honoured(
        kernelspec: str, engine: EngineEndpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The early start cannot read Jupyter's config files: the kernel sees the shape differs,
    and the sandbox made early is destroyed, not left running beside the right one."""
    profile = tmp_path / "ipython" / "profile_default"
    profile.mkdir(parents=True)
    (profile / "ipython_kernel_config.py").write_text(f"c.SandboxKernel.shape = {SMALL_SHAPE!r}\n")
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    before = asyncio.run(_statuses(engine))
    km, kc = start_new_kernel(kernel_name=kernelspec, startup_timeout=TIMEOUT)
    try:
        [status] = execute(kc, "%sandbox status").of_type("display_data")
        assert "s-1vcpu-256mb (1 vCPU, 256 MiB)" in status["data"]["text/plain"]
        made = {sandbox_id: status for sandbox_id, status in asyncio.run(_statuses(engine)).items()
                if sandbox_id not in before}
        assert sorted(made.values()) == sorted([SandboxStatus.DESTROYED, SandboxStatus.RUNNING])
    finally:
        kc.stop_channels()
        km.shutdown_kernel()
