"""`sandbox-kernel doctor` checks what the tour uses where it is needed: in the environment
JupyterLab and the kernel run from, and inside a real sandbox (what notebooks import), one
line each with the command that fixes it; and it says which environment the sandboxes see.

The environment here links to the test environment's packages but JupyterLab's and the
frontends of widgets and of the usage panel; its sandboxes see none of the linked ones (the links lead
into an environment they do not see): the two sides disagree, and each line says its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jupyter_core.paths
import pytest

from cli_helpers import cli
from linked_venv import linked_venv
from sandbox_kernel.cli.doctor import kernelspec_line
from sandbox_kernel.local.service import EngineEndpoint

pytestmark = pytest.mark.slow


def test_doctor_checks_each_side_for_itself(tmp_path: Path) -> None:
    # without JupyterLab either (jupyterlab, jupyterlab_widgets, jupyterlab_server...)
    python = linked_venv(tmp_path / "env", without=("jupyterlab", "jupyter_resource_usage"))
    # the 'sandbox' kernelspec, installed from the test environment: another one than the doctor's
    jupyter = tmp_path / "jupyter"
    cli("install", "--prefix", str(jupyter)).check_returncode()
    env = {**os.environ, "SANDBOX_KERNEL_STATE_DIR": str(tmp_path / "state"),
           "JUPYTER_PATH": str(jupyter / "share" / "jupyter"), "JUPYTER_DATA_DIR": str(tmp_path / "data")}
    try:
        done = subprocess.run([python, "-m", "sandbox_kernel", "doctor"], env=env, capture_output=True,
                              text=True, timeout=120)
    finally:  # the engine the sandbox check started
        subprocess.run([python, "-m", "sandbox_kernel", "serve", "--stop"], env=env, timeout=60)
    lines = done.stdout.splitlines()
    fix = f"fix: {python} -m pip install"
    assert done.returncode == 0, done.stdout + done.stderr  # isolation holds: packages do not fail it

    # this environment: the kernelspec starts another Python; the two frontends are missing,
    # nothing else is looked for
    frontend = lines[lines.index(f"the tour's packages in this environment (JupyterLab's and the kernel's, "
                                 f"{tmp_path / 'env'}):") + 1:]
    assert frontend[:4] == [
        f"  ✗ the 'sandbox' kernelspec ({jupyter / 'share' / 'jupyter' / 'kernels' / 'sandbox'}) starts "
        f"{sys.executable}: its notebooks see the packages of {sys.prefix}, not of this environment; "
        f"{python} -m sandbox_kernel install --prefix {jupyter} makes it start this one "
        f"(or run {sys.executable} -m sandbox_kernel doctor)",
        "  - jupyterlab is not installed here: the frontends below count where JupyterLab runs; "
        "install them there (or JupyterLab here)",
        f"  ✗ jupyterlab_widgets not installed: JupyterLab shows widgets and tqdm's notebook bars as text; "
        f"{fix} ipywidgets",
        f"  ✗ jupyter-resource-usage not installed: JupyterLab has no kernel usage panel; {fix} jupyter-resource-usage"]

    # inside a sandbox: this environment, where none of them is, though the host imports them
    subprocess.run([python, "-c", "import ipywidgets, tqdm, debugpy"], check=True, timeout=60)
    sandbox = lines[lines.index("the tour's packages inside a sandbox (what notebooks import; "
                                "a throw-away sandbox is asked):") + 1:]
    assert sandbox == [
        f"  sandboxes see the Python environment {tmp_path / 'env'} (this one, read-only)",
        *(f"  ✗ {name} not installed: notebooks cannot import it ({use}); {fix} {name} "
          f"(or %pip install {name} in a notebook, for its sandbox only)"
          for name, use in (("ipywidgets", "widgets, and tqdm's notebook bars"), ("tqdm", "progress bars"),
                            ("debugpy", "the debugger")))]


def test_doctor_asks_a_createos_sandbox_too(engine: EngineEndpoint) -> None:
    """Through the CreateOS code path (the local engine answering it): the sandbox's own
    Python is asked, whatever it is, and a fix is a `%pip install` in the notebook."""
    done = cli("doctor", CREATEOS_SANDBOX_BASE_URL=engine.url, CREATEOS_SANDBOX_API_KEY=engine.token)
    lines = done.stdout.splitlines()
    sandbox = lines[lines.index("the tour's packages inside a sandbox (what notebooks import; "
                                "a throw-away sandbox is asked):") + 1:]
    assert sandbox[0] == f"  sandboxes see the Python environment {os.path.realpath(sys.prefix)} (the rootfs's)"
    assert [line.split()[:2] for line in sandbox[1:]] == [["✓", "ipywidgets"], ["✓", "tqdm"], ["✓", "debugpy"]]
    assert engine.token not in done.stdout + done.stderr


def test_doctor_says_which_python_the_kernelspec_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "share" / "jupyter"))
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "data"))
    # Neither this environment's kernelspecs (the README's quick start installs one with
    # --sys-prefix) nor the system's: only what this test installs.
    monkeypatch.setattr(jupyter_core.paths, "ENV_JUPYTER_PATH", [])
    monkeypatch.setattr(jupyter_core.paths, "SYSTEM_JUPYTER_PATH", [])
    assert kernelspec_line() == f"- no 'sandbox' kernelspec installed: {sys.executable} -m sandbox_kernel install --user"
    cli("install", "--prefix", str(tmp_path)).check_returncode()
    assert kernelspec_line() == (f"✓ the 'sandbox' kernelspec ({tmp_path / 'share' / 'jupyter' / 'kernels' / 'sandbox'}) "
                                 "starts this environment's Python")
