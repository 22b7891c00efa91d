"""Version skew: the runner's bundle has a content hash the runner reports, so a kernel
never takes a runner of another sandbox-kernel version for its own.

"Another version" is simulated honestly: a copy of this package that differs from it by one
comment line in a bundle file, from which real kernels are started (PYTHONPATH), as after a
`pip install -U` next to a notebook of the version before. Its kernels upload their bundle
and start their runner exactly as any kernel does. Real engine, real kernels.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.blocking.client import BlockingKernelClient
from jupyter_client.manager import KernelManager

from kernel_helpers import execute, running_kernel
from sandbox_kernel.sandbox import pool
from sandbox_kernel.guest import bundle as runner_bundle
from sandbox_kernel.api import SandboxClient
from sandbox_kernel.config import ENV_VARS
from sandbox_kernel.local.service import EngineEndpoint
from sandbox_kernel.sandbox.runner_setup import RUNNER_DIR

BUNDLE_DIR = Path(runner_bundle.__file__).parent
MARK = "# the other version\n"  # what the other version's protocol.py ends with
MARKED_FILE = f"{RUNNER_DIR}/{runner_bundle.PACKAGE}/protocol.py"  # in the sandbox
MARKED = f"print(open({MARKED_FILE!r}).read().endswith({MARK!r}))"
SANDBOX_ID = "import os\nprint(os.environ['SANDBOX_ID'])"


def other_version_line(sandbox_id: str) -> str:
    return (f"Sandbox {sandbox_id} runs a Python runner of another sandbox-kernel version, kept with its "
            f"variables; `%sandbox attach {sandbox_id} --restart-runner` starts this version's "
            "(variables and imports are lost, files are kept)")


# -- the hash (no sandbox) ----------------------------------------------------------------


def test_the_hash_changes_with_any_bundle_file_and_only_then(tmp_path: Path) -> None:
    uploaded = {tmp_path / path: Path(source) for path, source in runner_bundle.runner_files().items()}
    for copy, source in uploaded.items():
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source, copy)
    package = tmp_path / runner_bundle.PACKAGE
    # Not the runner's: the agent's part of the package, compiled modules.
    (package / "agent").mkdir()
    (package / "agent" / "agent.py").write_text("x = 1\n")
    (package / "runner" / "__pycache__").mkdir()
    (package / "runner" / "__pycache__" / "daemon.cpython-311.pyc").write_bytes(b"1")
    original = runner_bundle.bundle_hash(str(package))
    assert original == runner_bundle.own_hash() == runner_bundle.bundle_hash(str(BUNDLE_DIR))
    (package / "agent" / "agent.py").write_text("x = 2\n")  # not the bundle's: no change
    (package / "runner" / "__pycache__" / "daemon.cpython-311.pyc").write_bytes(b"2")
    (package / "runner" / "daemon.py").touch()  # a new mtime, the same content: no change
    assert runner_bundle.bundle_hash(str(package)) == original
    seen = {original}
    for copy in uploaded:
        content = copy.read_bytes()
        copy.write_bytes(content + b"\n")
        changed = runner_bundle.bundle_hash(str(package))
        assert changed not in seen, copy
        seen.add(changed)
        copy.write_bytes(content)
        assert runner_bundle.bundle_hash(str(package)) == original
    # A module more (one an older upload left behind) is another bundle...
    (package / "runner" / "left_behind.py").write_text("")
    assert runner_bundle.bundle_hash(str(package)) not in seen
    (package / "runner" / "left_behind.py").unlink()
    # ... and so is a byte moved from one file to the next.
    first, second = sorted(uploaded)[:2]
    a, b = first.read_bytes(), second.read_bytes()
    first.write_bytes(a[:-1])
    second.write_bytes(a[-1:] + b)
    assert runner_bundle.bundle_hash(str(package)) not in seen


def test_the_upload_is_the_package_and_starts_as_one(tmp_path: Path) -> None:
    """Every module of the runner is uploaded, derived from the package (no hand list), and
    the directory the upload command prepares holds them all."""
    runner_modules = {path.name for path in (BUNDLE_DIR / "runner").glob("*.py")}
    files = runner_bundle.runner_files()
    assert {Path(path).name for path in files if "/runner/" in path} == runner_modules
    assert f"{runner_bundle.PACKAGE}/protocol.py" in files and not any("/agent/" in path for path in files)
    root = tmp_path / "root"
    (root / runner_bundle.PACKAGE / "stale").mkdir(parents=True)  # a previous upload's
    subprocess.run(["sh", "-c", runner_bundle.prepare_command(str(root))], check=True)
    assert not (root / runner_bundle.PACKAGE / "stale").exists()
    assert all((root / path).parent.is_dir() for path in files)
    assert runner_bundle.client_path(str(root)) == str(root / runner_bundle.PACKAGE / "runner" / "client.py")
    assert (Path(runner_bundle.runner_path(str(root))) / "__main__.py").relative_to(root).as_posix() in files


def test_the_upload_carries_the_hosts_bytecode_which_the_sandbox_python_takes(tmp_path: Path) -> None:
    """A module goes with the host's bytecode of it and its own modification time: unpacked
    by tar (as the start does) and imported by the same Python, the bytecode is taken as it
    is, not compiled again (Python would rewrite a stale one)."""
    import py_compile
    import sys

    from sandbox_kernel.sandbox.runner_setup import bundle_tar

    source = tmp_path / "host" / "pkg" / "light.py"
    source.parent.mkdir(parents=True)
    source.write_text("ANSWER = 42\n")
    os.utime(source, (1_700_000_000.5, 1_700_000_000.5))
    compiled = Path(py_compile.compile(str(source), doraise=True))
    sandbox = tmp_path / "sandbox"
    sandbox.mkdir()
    (tmp_path / "bundle.tar").write_bytes(bundle_tar.__wrapped__((("pkg/light.py", source),)))
    subprocess.run(["tar", "-xf", str(tmp_path / "bundle.tar"), "-C", str(sandbox)], check=True)
    shipped = sandbox / "pkg" / "__pycache__" / compiled.name
    assert shipped.read_bytes() == compiled.read_bytes()
    assert int((sandbox / "pkg" / "light.py").stat().st_mtime) == int(source.stat().st_mtime)
    shipped_at = shipped.stat().st_mtime_ns
    done = subprocess.run([sys.executable, "-c", "import light; print(light.ANSWER)"], cwd=sandbox / "pkg",
                          capture_output=True, text=True, check=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": ""})
    assert done.stdout == "42\n"
    assert shipped.stat().st_mtime_ns == shipped_at, "the shipped bytecode was taken, not rewritten"


def test_a_runner_that_reports_no_hash_runs_another_bundle() -> None:
    """A runner older than the hash reports none: it is another version, not ours."""
    assert runner_bundle.runs_this_bundle({runner_bundle.INFO_FIELD: runner_bundle.own_hash()})
    assert not runner_bundle.runs_this_bundle({"python_version": "3.11.7"})
    assert not runner_bundle.runs_this_bundle({runner_bundle.INFO_FIELD: "0" * 16})


# -- kernels of two versions ----------------------------------------------------------------


@pytest.fixture(scope="module")
def other_version(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory for PYTHONPATH holding this package with one comment line added to a
    bundle file: another sandbox-kernel version."""
    root = tmp_path_factory.mktemp("other-version")
    shutil.copytree(BUNDLE_DIR.parent, root / "sandbox_kernel", ignore=shutil.ignore_patterns("__pycache__"))
    with open(root / "sandbox_kernel" / BUNDLE_DIR.name / "protocol.py", "a") as file:
        file.write(MARK)
    return root


def other_version_kernel(kernelspec: str, root: Path) -> contextlib.AbstractContextManager[
        tuple[KernelManager, BlockingKernelClient]]:
    # Started outside the worktree: `python -m` puts the working directory first on sys.path.
    return running_kernel(kernelspec, env={**os.environ, "PYTHONPATH": str(root)}, cwd=str(root))


@contextlib.contextmanager
def attached_kernel(kernelspec: str, sandbox_id: str) -> Iterator[BlockingKernelClient]:
    """A kernel started attached to sandbox_id (SANDBOX_KERNEL_SANDBOX_ID)."""
    env = {**os.environ, ENV_VARS["sandbox_id"]: sandbox_id}
    with running_kernel(kernelspec, env=env) as (_, kc):
        yield kc


@pytest.mark.slow
def test_a_runner_of_another_version_is_kept_said_once_and_restarted_on_request(
        kernelspec: str, other_version: Path) -> None:
    with other_version_kernel(kernelspec, other_version) as (_, older):
        # The other version's runner really runs there, from its own bundle.
        assert execute(older, MARKED).text() == "True\n"
        sandbox = execute(older, SANDBOX_ID).text().strip()
        assert execute(older, "x = 41").reply["content"]["status"] == "ok"

        # A kernel of this version started attached to it: one line in its first cell, once.
        with attached_kernel(kernelspec, sandbox) as kc:
            first = execute(kc, "print(x + 1)")
            assert first.text() == "42\n" and first.text("stderr") == other_version_line(sandbox) + "\n"
            again = execute(kc, "print(x)")
            assert again.text() == "41\n" and again.text("stderr") == ""

        # %sandbox attach: the runner and its variables are kept, and the line says why.
        with running_kernel(kernelspec) as (_, kc):
            attached = execute(kc, f"%sandbox attach {sandbox}")
            assert attached.reply["content"]["status"] == "ok"
            assert other_version_line(sandbox) in attached.text().splitlines()
            assert execute(kc, "print(x)").text() == "41\n"
            # Asked for: a fresh runner of this version, in the sandbox this notebook drives.
            restarted = execute(kc, f"%sandbox attach {sandbox} --restart-runner")
            assert restarted.reply["content"]["status"] == "ok" and "another" not in restarted.text()
            gone = execute(kc, "x")
            assert gone.reply["content"]["status"] == "error" and gone.reply["content"]["ename"] == "NameError"
            assert execute(kc, MARKED).text() == "False\n"

        # Its runner is this version's now: a kernel attaching keeps it and says nothing.
        with attached_kernel(kernelspec, sandbox) as kc:
            quiet = execute(kc, "print('here')")
            assert quiet.text() == "here\n" and quiet.text("stderr") == ""


@pytest.mark.slow
def test_a_pool_member_of_another_version_is_not_claimed(
        kernelspec: str, engine: EngineEndpoint, other_version: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VARS["warm_pool"], "1")
    before = set(pool.all_members())
    made: set[str] = set()
    try:
        with other_version_kernel(kernelspec, other_version) as (_, older):
            execute(older, "1")  # its start tops its pool up: one member, of the other version
            made = wait_for_new_members(before)
        [member] = made
        # Proof that the member runs the other version's runner, from its bundle.
        assert sandbox_run(engine, member, f"tail -c {len(MARK)} {MARKED_FILE}") == MARK
        with running_kernel(kernelspec) as (_, kc):
            started_on = execute(kc, SANDBOX_ID).text().strip()
            made |= wait_for_new_members(before | made)  # this version's pool fills up
        assert started_on != member
        assert member in pool.all_members()  # still waiting for a kernel of its version
    finally:
        destroy(engine, made)


def wait_for_new_members(known: set[str], timeout: float = 120.0) -> set[str]:
    deadline = time.monotonic() + timeout
    while not (new := set(pool.all_members()) - known):
        assert time.monotonic() < deadline, "no pool member was made"
        time.sleep(0.2)
    return new


def sandbox_run(engine: EngineEndpoint, sandbox_id: str, command: str) -> str:
    async def run() -> Any:
        async with SandboxClient(engine.url, engine.token) as client:
            return (await client.exec(sandbox_id, "sh", ["-c", command])).result.stdout

    return asyncio.run(run())


def destroy(engine: EngineEndpoint, sandbox_ids: set[str]) -> None:
    async def run() -> None:
        async with SandboxClient(engine.url, engine.token) as client:
            for sandbox_id in sandbox_ids:
                with contextlib.suppress(Exception):
                    await client.delete_sandbox(sandbox_id)

    asyncio.run(run())
    for sandbox_id in sandbox_ids:
        pool.forget(sandbox_id)
