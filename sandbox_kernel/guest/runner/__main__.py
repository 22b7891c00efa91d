"""Starts the runner daemon: ``python3 BUNDLE/<package>/runner serve DIR`` in a sandbox (the
bundle as bundle.py uploads it), ``python3 -m sandbox_kernel.guest.runner serve DIR`` on a host.
"""
import importlib.machinery
import os
import sys

if not __package__:
    # Started by path: Python put this directory first on sys.path and runs this file
    # outside its package. The package's parent (the bundle's root) takes that place, so
    # the runner's modules import as modules of their package, never under bare names that
    # a user's module could be confused with; the daemon swaps that entry for '' once its
    # own imports are done (daemon._look_in_working_directory_first). This file becomes
    # the package's __main__ module (spec and package agree: Python 3.12+ warns otherwise).
    _package_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[0] = os.path.dirname(_package_dir)
    __spec__ = importlib.machinery.ModuleSpec(os.path.basename(_package_dir) + ".runner.__main__", None,
                                              origin=__file__)
    __package__ = __spec__.parent

from .daemon import main  # noqa: E402 - needs the package set up above

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
