"""Notebooks sealed by their metadata: a headless run gets exactly the network and the host
variables its author sealed in `metadata.sandbox`, whatever the runner's own configuration
says, and a seal that cannot be applied refuses the run with one line, before any kernel."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import nbformat
import pytest

from named_servers import FETCH, named_servers

pytestmark = [pytest.mark.slow, pytest.mark.one_path]


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[int, ...]]:
    with named_servers("A", "B") as ports:
        yield ports



def sealed(path: Path, kernelspec: str, seal: dict, *cells: str) -> Path:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code) for code in cells], metadata={
        "kernelspec": {"name": kernelspec, "display_name": "sandbox", "language": "python"}, "sandbox": seal})
    nbformat.write(nb, path)
    return path


def run(path: Path, kernelspec: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sandbox_kernel", "run", str(path), "--kernel", kernelspec, *args],
                          capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


def test_the_sealed_rules_are_enforced_over_the_runners_own(
        kernelspec: str, servers: tuple[int, int], tmp_path: Path) -> None:
    a, b = servers
    path = sealed(tmp_path / "sealed.ipynb", kernelspec, {"egress": [f"127.0.0.1:{a}"]},
                  FETCH, f"print(fetch({a}), fetch({b}))")
    # The runner's own configuration would allow only B: the notebook's seal decides.
    result = run(path, kernelspec, env={"SANDBOX_KERNEL_EGRESS": f"127.0.0.1:{b}"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "A HTTP 403\n" in result.stdout


def test_a_seal_that_cannot_be_applied_refuses_the_run_with_one_line(kernelspec: str, tmp_path: Path) -> None:
    path = sealed(tmp_path / "bad.ipynb", kernelspec, {"egress": ["10.0.0.1/8"]}, "print('ran')")
    result = run(path, kernelspec)
    assert result.returncode == 1 and "ran" not in result.stdout
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("sandbox-kernel: metadata.sandbox.egress: ")


def test_a_sealed_host_variable_enters_only_when_the_runner_allows_it(kernelspec: str, tmp_path: Path) -> None:
    path = sealed(tmp_path / "env.ipynb", kernelspec, {"env": ["SEALED_TEST_SECRET"]},
                  "import os; print('got', os.environ.get('SEALED_TEST_SECRET'))")
    env = {"SEALED_TEST_SECRET": "s3cr3t-value"}
    # Allowed: the value really reaches the notebook's Python (so the way in is real)...
    allowed = run(path, kernelspec, "--allow-env", "SEALED_TEST_SECRET", env=env)
    assert allowed.returncode == 0 and "got s3cr3t-value\n" in allowed.stdout, allowed.stderr
    # ... and without the runner's word, the notebook cannot ask for it: nothing runs.
    refused = run(path, kernelspec, env=env)
    assert refused.returncode == 1 and "got" not in refused.stdout
    assert refused.stderr == ("sandbox-kernel: metadata.sandbox.env asks for the host's SEALED_TEST_SECRET: "
                              "pass --allow-env SEALED_TEST_SECRET (or list it in SANDBOX_KERNEL_ALLOW_ENV) "
                              "to hand it to the sandbox\n")


def test_papermill_with_the_sandbox_engine_applies_the_seal(
        kernelspec: str, servers: tuple[int, int], tmp_path: Path) -> None:
    a, b = servers
    path = sealed(tmp_path / "sealed.ipynb", kernelspec, {"egress": [f"127.0.0.1:{a}"]},
                  FETCH, f"print(fetch({a}), fetch({b}))")
    output = tmp_path / "out.ipynb"
    result = subprocess.run(
        [sys.executable, "-m", "papermill", "--engine", "sandbox", "-k", kernelspec, str(path), str(output),
         "--no-progress-bar"], capture_output=True, text=True, timeout=120,
        env={**os.environ, "SANDBOX_KERNEL_EGRESS": f"127.0.0.1:{b}"})
    assert result.returncode == 0, result.stderr
    outputs = nbformat.read(output, as_version=4).cells[1].outputs
    assert "".join(o.text for o in outputs if o.get("name") == "stdout") == "A HTTP 403\n"
