"""The README's tour, run as written: the shell lines of its steps, in a shell, with this
environment's `bin` first on PATH (what `. .venv/bin/activate` does) and Jupyter's data
dir private (`install --user` writes there). Left out, and why: creating the venv and `pip
install` (this run is already installed into one), `jupyter lab` and `jupyter console`
(interactive; tests/browser/test_browser.py and tests/e2e/test_console.py drive them)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
NOT_RUN = ("jupyter lab", "jupyter console", "python3 -m venv", ". .venv/bin/activate", "pip install")


def tour_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    tour = readme.split("## A 5-minute tour", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", tour, flags=re.DOTALL)
    lines = [line.strip() for block in blocks for line in block.splitlines() if line.strip()]
    commands = []
    for line in lines:  # `a && b && c`: keep the parts that are not interactive or installs
        parts = [part.strip() for part in line.split("&&")]
        kept = [part for part in parts if not part.startswith(NOT_RUN)]
        if kept:
            commands.append(" && ".join(kept))
    return commands


def test_the_tour_commands_run_as_written(engine: object, tmp_path: Path) -> None:
    commands = tour_commands()
    assert any(c.startswith("sandbox-kernel install --user") for c in commands), commands
    assert any(c.startswith("papermill examples/egress-lockdown.ipynb") for c in commands), commands
    work = tmp_path / "checkout"
    work.mkdir()
    (work / "examples").symlink_to(ROOT / "examples")
    env = {**os.environ, "JUPYTER_DATA_DIR": str(tmp_path / "jupyter-data"),
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    env.pop("JUPYTER_PATH", None)  # only what the tour itself installed
    env.pop("CREATEOS_SANDBOX_API_KEY", None)
    for command in commands:
        done = subprocess.run(["bash", "-c", command], cwd=work, env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        if command.startswith("sandbox-kernel run"):
            assert done.stdout.strip().splitlines()[-1].endswith(", no errors")
    assert (work / "out.ipynb").exists()
