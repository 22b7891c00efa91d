"""The peer suites' sources: the test folders of the sdists of the installed ipykernel and
nbclient, fetched with pip from the package index the project installs from, at test time.

Nothing of theirs is in this repository. The sdist of exactly the installed version is taken
(pyproject's test extra pins those versions), unpacked once into a cache folder and reused.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from importlib.metadata import version
from pathlib import Path


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sandbox-kernel" / "peer-suites"


def sdist_tree(distribution: str) -> Path:
    """The unpacked sdist of the installed `distribution` (its tests/ folder included)."""
    release = f"{distribution}-{version(distribution)}"
    target = cache_root() / release
    if (target / "tests").is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        # --no-binary for this one package only: its build backend may come as a wheel
        # (pip prepares the sdist's metadata with it).
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
             "--no-binary", distribution, "--dest", tmp, f"{distribution}=={version(distribution)}"],
            check=True, timeout=600)
        archives = list(Path(tmp).glob("*.tar.gz"))
        if len(archives) != 1:
            raise RuntimeError(f"pip download {release} gave {archives}, not one sdist")
        with tarfile.open(archives[0]) as archive:
            archive.extractall(tmp, filter="data")  # no links or paths out of tmp
        unpacked = [p for p in Path(tmp).iterdir() if p.is_dir()]
        if len(unpacked) != 1 or not (unpacked[0] / "tests").is_dir():
            raise RuntimeError(f"the sdist of {release} has no tests/ folder")
        try:
            os.replace(unpacked[0], target)  # atomic: a concurrent run sees all of it or nothing
        except OSError:
            if not (target / "tests").is_dir():
                raise  # not a concurrent run that got there first
    return target
