"""A kernel uses the engine of its own Python environment (issue 36, item 5): two
environments, a kernel from each, one state dir. Each kernel's sandboxes see its own
environment's packages (a module installed only in it), never the other's; `sandbox-kernel
ls` and `serve --stop` run from an environment reach that environment's engine, and ls says
where the other environment's sandboxes are; gc from one leaves the other's alone."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kernel_helpers import execute, running_kernel
from linked_venv import linked_venv

pytestmark = [pytest.mark.slow, pytest.mark.one_path]  # the engine a kernel reaches: local only


def sandbox_kernel(python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([python, "-m", "sandbox_kernel", *args], capture_output=True, text=True, timeout=120)


def test_each_environment_has_its_engine_and_its_sandboxes_see_its_packages(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDBOX_KERNEL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("CREATEOS_SANDBOX_API_KEY", raising=False)
    pythons = {name: linked_venv(tmp_path / f"env-{name}", modules={f"only_in_{name}": f"WHERE = {name!r}\n"})
               for name in ("a", "b")}
    jupyter = tmp_path / "jupyter"
    for name, python in pythons.items():
        sandbox_kernel(python, "install", "--prefix", str(jupyter), "--name", f"sandbox-env-{name}").check_returncode()
    monkeypatch.setenv("JUPYTER_PATH", str(jupyter / "share" / "jupyter"))
    try:
        with running_kernel("sandbox-env-a") as (_, a), running_kernel("sandbox-env-b") as (_, b):
            ids = {}
            for name, other, kc in (("a", "b", a), ("b", "a", b)):
                seen = execute(kc, f"import os, sys, only_in_{name}\n"
                                   f"print(only_in_{name}.WHERE, sys.prefix, os.environ['SANDBOX_ID'])")
                where, prefix, ids[name] = seen.text().split()
                assert (where, prefix) == (name, str(tmp_path / f"env-{name}")), seen.outputs
                missing = execute(kc, f"import only_in_{other}")
                assert missing.of_type("error")[0]["ename"] == "ModuleNotFoundError", missing.outputs

            # the command line from each environment reaches that environment's engine
            for name, other in (("a", "b"), ("b", "a")):
                listed = sandbox_kernel(pythons[name], "ls")
                assert listed.returncode == 0, listed.stderr
                assert ids[name] in listed.stdout and ids[other] not in listed.stdout, listed.stdout
                assert (f"1 more sandbox(es) run on the engine of another Python environment, "
                        f"{tmp_path / f'env-{other}'}: {pythons[other]} -m sandbox_kernel ls") in listed.stdout
            # gc from one environment leaves the other's sandboxes their owner (no orphan here)
            assert sandbox_kernel(pythons["a"], "gc").stdout == "no orphaned sandboxes on the local engine\n"
            listed = sandbox_kernel(pythons["b"], "ls").stdout.splitlines()
            assert "owner: kernel " in next(line for line in listed if line.startswith(ids["b"])), listed
    finally:
        stopped = {name: sandbox_kernel(python, "serve", "--stop").stdout for name, python in pythons.items()}
    assert stopped == {name: "local engine stopped; its sandboxes keep running for the next one\n"
                       for name in pythons}
