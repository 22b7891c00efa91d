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
            extract_plainly(archive, Path(tmp))
        unpacked = [p for p in Path(tmp).iterdir() if p.is_dir()]
        if len(unpacked) != 1 or not (unpacked[0] / "tests").is_dir():
            raise RuntimeError(f"the sdist of {release} has no tests/ folder")
        try:
            os.replace(unpacked[0], target)  # atomic: a concurrent run sees all of it or nothing
        except OSError:
            if not (target / "tests").is_dir():
                raise  # not a concurrent run that got there first
    return target


def extract_plainly(archive: tarfile.TarFile, into: Path) -> None:
    """Files and folders only, none out of `into`: tarfile's "data" filter where this Python
    has it (3.11.4 on), the same checks by hand before that (Debian 12's Python is 3.11.2)."""
    if hasattr(tarfile, "data_filter"):
        archive.extractall(into, filter="data")
        return
    for member in archive.getmembers():
        inside = (into / member.name).resolve()
        if not (member.isfile() or member.isdir()) or into.resolve() not in inside.parents:
            raise RuntimeError(f"{member.name!r} in the sdist is not a plain file inside it")
    archive.extractall(into)
