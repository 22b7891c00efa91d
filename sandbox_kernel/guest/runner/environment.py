"""The sandbox's Python environment as the runner sets it up: where pip installs (on the
sandbox's own disk, importable at once and after a restart), and what is importable.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

# Where pip installs inside the sandbox: on its own disk, kept across kernel restarts.
PACKAGES_PREFIX = "~/.local"


def _file_loaders() -> list:
    """What the standard path finder loads from a directory (importlib's own order)."""
    machinery = importlib.machinery
    return [(machinery.ExtensionFileLoader, machinery.EXTENSION_SUFFIXES),
            (machinery.SourceFileLoader, machinery.SOURCE_SUFFIXES),
            (machinery.SourcelessFileLoader, machinery.BYTECODE_SUFFIXES)]


def use_workspace_packages() -> None:
    """`%pip install` and `!pip install` write to PACKAGES_PREFIX on the sandbox's own disk
    (the Python environment may be read-only, as the local engine's is), and what is there
    is importable: by this runner, by its subprocesses, and after a restart (a new runner
    sets this up again; the files stay). pip follows PIP_PREFIX like its --prefix option."""
    import site
    import sysconfig

    prefix = os.path.expanduser(PACKAGES_PREFIX)
    scheme = {"base": prefix, "platbase": prefix}
    site_dirs = []
    for kind in ("purelib", "platlib"):
        path = sysconfig.get_path(kind, "posix_prefix", vars=scheme)
        if path not in site_dirs:
            site_dirs.append(path)
    os.environ.setdefault("PIP_PREFIX", prefix)
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(site_dirs + inherited)
    os.environ["PATH"] = os.path.join(prefix, "bin") + os.pathsep + os.environ.get("PATH", "")
    # Ahead of the environment's own site-packages, so an installed version wins; .pth
    # files in them are processed as in any site dir.
    first_site = next((i for i, p in enumerate(sys.path) if p.endswith(("site-packages", "dist-packages"))),
                      len(sys.path))
    sys.path[first_site:first_site] = [p for p in site_dirs if p not in sys.path]
    for path in site_dirs:
        if os.path.isdir(path):
            site.addsitedir(path)
        else:
            # Not created until pip installs something (the sandbox starts empty). Python
            # would remember a missing directory as "no finder" and never look again; a
            # finder of its own notices when the directory appears.
            sys.path_importer_cache[path] = importlib.machinery.FileFinder(path, *_file_loaders())


def importable(module_name: str) -> bool:
    return importlib.util.find_spec(module_name) is not None
