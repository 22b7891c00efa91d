"""`sandbox-kernel sweep` end to end: the setup runs once, every branch goes on from its live
state in a fork, a failing branch is reported while the others finish, and no fork outlives
the sweep, neither at its end nor after Ctrl-C. Run on both code paths: the sweep forks and
destroys through the sandbox API, as the CreateOS provider does."""

from __future__ import annotations

import asyncio
import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from sandbox_kernel.api import SandboxClient
from sandbox_kernel.api import names
from sandbox_kernel.local.service import EngineEndpoint

pytestmark = [pytest.mark.slow]

SETUP = ("import secrets, time\n"
         "token = secrets.token_hex(8)\n"
         "state = {'built': True}\n"
         "print('setup', token, id(state))")
BRANCH = "result = 12 // alpha\nprint(token, id(state), alpha, result)"


def notebook(path: Path, kernelspec: str, branch: str = BRANCH, **metadata: object) -> Path:
    parameters = nbformat.v4.new_code_cell("alpha = 1")
    parameters.metadata["tags"] = ["parameters"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(SETUP), parameters,
                                         nbformat.v4.new_code_cell(branch)],
                                  metadata={"kernelspec": {"name": kernelspec, "display_name": "sandbox",
                                                           "language": "python"}, **metadata})
    nbformat.write(nb, path)
    return path


def live_ids(engine: EngineEndpoint) -> set[str]:
    async def listed() -> set[str]:
        async with SandboxClient(engine.url, engine.token) as client:
            return {view.id for view in names.live(await client.list_sandboxes())}
    return asyncio.run(listed())


def forks_of_live(engine: EngineEndpoint, before: set[str]) -> dict[str, list[str] | None]:
    """Live forks made since `before` -> their egress rules (another test in the same run may
    leave a fork of its own alive)."""
    async def listed() -> dict[str, list[str] | None]:
        async with SandboxClient(engine.url, engine.token) as client:
            return {view.id: view.egress for view in names.live(await client.list_sandboxes())
                    if view.forked_from and view.id not in before}
    return asyncio.run(listed())


def doomed_since(before: set[str]) -> list[str]:
    """The sandboxes gc would destroy, apart from those that existed before the test (other
    tests in the same run may leave orphans of their own)."""
    return [line for line in gc_dry_run().splitlines()
            if "would destroy" in line and line.split(":")[0] not in before]


def gc_dry_run() -> str:
    return subprocess.run([sys.executable, "-m", "sandbox_kernel", "gc", "--dry-run"],
                          capture_output=True, text=True, timeout=60).stdout


def stream(nb: nbformat.NotebookNode, index: int) -> str:
    return "".join(o.get("text", "") for o in nb.cells[index].outputs if o.output_type == "stream")


def test_branches_go_on_from_one_live_state_and_a_failing_one_is_reported(
        kernelspec: str, engine: EngineEndpoint, tmp_path: Path) -> None:
    before = live_ids(engine)
    source = notebook(tmp_path / "exp.ipynb", kernelspec)
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "sandbox_kernel", "sweep", str(source), "-p", "alpha", "3", "4", "0",
         "--kernel", kernelspec, "--output-dir", str(out), "--collect", "result", "--jobs", "3"],
        capture_output=True, text=True, timeout=170)
    assert result.returncode == 1, result.stderr  # one branch failed

    tokens = set()
    for alpha, expected in (("3", 4), ("4", 3)):
        nb = nbformat.read(out / f"exp-alpha={alpha}.ipynb", as_version=4)
        setup_token = stream(nb, 0).split()[1]
        assert nb.cells[2].metadata["tags"] == ["injected-parameters"]
        assert nb.cells[2].source == f"# Parameters\nalpha = {alpha}\n"
        token, state_id, seen_alpha, seen_result = stream(nb, 3).split()
        # The branch's Python is the setup's: the same random token and the same object,
        # made once (the setup ran once: its output is the same in every notebook).
        assert token == setup_token and f"setup {token} {state_id}\n" == stream(nb, 0)
        assert (seen_alpha, seen_result) == (alpha, str(expected))
        tokens.add(token)
    assert len(tokens) == 1
    failed = nbformat.read(out / "exp-alpha=0.ipynb", as_version=4)
    assert [o.ename for o in failed.cells[3].outputs if o.output_type == "error"] == ["ZeroDivisionError"]

    assert "ZeroDivisionError" in result.stderr  # said as it happened
    assert "2 of 3 branches ok, 1 failed" in result.stdout
    rows = list(csv.DictReader((out / "exp-summary.csv").open()))
    assert [(row["alpha"], row["status"], row["result"]) for row in rows] == [
        ("3", "ok", "4"), ("4", "ok", "3"), ("0", "failed", "<NameError>")]
    assert "&lt;NameError&gt;" in (out / "exp-summary.html").read_text()

    assert live_ids(engine) <= before  # the source and every fork are gone
    assert not doomed_since(before)


def test_ctrl_c_mid_sweep_leaves_no_fork(kernelspec: str, engine: EngineEndpoint, tmp_path: Path) -> None:
    before = live_ids(engine)
    # Sealed: the branches' sandboxes have the notebook's network rules (forks of the setup's).
    source = notebook(tmp_path / "slow.ipynb", kernelspec, branch="import time\ntime.sleep(120)",
                      sandbox={"egress": ["127.0.0.1:9"]})
    sweep = subprocess.Popen(
        [sys.executable, "-m", "sandbox_kernel", "sweep", str(source), "-p", "alpha", "1", "2",
         "--kernel", kernelspec, "--output-dir", str(tmp_path / "out"), "--jobs", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(forks_of_live(engine, before)) < 2:
            assert sweep.poll() is None and time.monotonic() < deadline, sweep.communicate()
            time.sleep(0.2)
        assert list(forks_of_live(engine, before).values()) == [["127.0.0.1:9"]] * 2
        # Mid-sweep every fork has a live owner: gc would destroy none of them.
        assert not doomed_since(before)
        listed = subprocess.run([sys.executable, "-m", "sandbox_kernel", "ls"], capture_output=True,
                                text=True, timeout=60).stdout
        assert all("owner: kernel " in line for line in listed.splitlines()
                   if line.split()[0] in forks_of_live(engine, before)), listed
        # Ctrl-C in a terminal: SIGINT to the whole foreground process group.
        os.killpg(sweep.pid, signal.SIGINT)
        stdout, stderr = sweep.communicate(timeout=90)
    finally:
        if sweep.poll() is None:
            os.killpg(sweep.pid, signal.SIGKILL)
    assert sweep.returncode == 130, stderr
    assert "interrupted; every fork was destroyed" in stderr
    assert live_ids(engine) <= before
    assert not doomed_since(before)
