"""Everything under sandbox_kernel/guest/ runs inside sandboxes, whose Python is not the
host's: every module imports only the standard library, the guest package itself (never the
host side of sandbox_kernel), and the few packages of the sandbox's own environment it uses
where they are installed (imports inside functions count too), and is Python 3.8 syntax."""

from __future__ import annotations

import ast
import importlib
import sys
import tomllib
from pathlib import Path

import pytest

import sandbox_kernel.guest

GUEST = Path(sandbox_kernel.guest.__file__).parent
PACKAGE = "sandbox_kernel.guest"
# Of the sandbox's Python environment, each imported only where installed (ImportError
# handled): IPython with its traitlets, the comm package, debugpy with its pydevd, pybase64.
SANDBOX_PACKAGES = frozenset(("IPython", "traitlets", "comm", "debugpy", "_pydevd_bundle", "pybase64"))
# Standard library modules of other Python versions than the host's (3.8 to the newest).
OTHER_VERSIONS_STDLIB = frozenset(("_sha2", "_sha256"))


def module_name(path: Path) -> str:
    parts = path.relative_to(GUEST).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((PACKAGE, *parts))


def imports_of(path: Path, name: str) -> list[tuple[int, str]]:
    """(line, absolute name) of every module `path` (module `name`) imports, relative imports resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if package.count(".") < node.level - 1:  # above the top-level package: not ours
                    found.append((node.lineno, "." * node.level + (node.module or "")))
                    continue
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
                # `from . import x` may import the submodule x
                found += [(node.lineno, target)] + [(node.lineno, f"{target}.{alias.name}") for alias in node.names
                                                    if node.module is None]
            else:
                found.append((node.lineno, node.module))
    return found


def foreign_imports(path: Path, module: str | None = None) -> list[str]:
    """`file:line: name` of each import of neither the standard library nor the guest package."""
    allowed = set(sys.stdlib_module_names) | SANDBOX_PACKAGES | OTHER_VERSIONS_STDLIB
    bad = []
    for line, name in imports_of(path, module or module_name(path)):
        if name == PACKAGE or name.startswith(PACKAGE + "."):
            continue
        if name.partition(".")[0] not in allowed or name.startswith("sandbox_kernel"):
            bad.append(f"{path.name}:{line}: {name}")
    return bad


GUEST_MODULES = sorted(GUEST.rglob("*.py"))


def test_every_guest_module_is_seen() -> None:
    names = {module_name(path) for path in GUEST_MODULES}
    assert {"sandbox_kernel.guest.protocol", "sandbox_kernel.guest.runner.daemon",
            "sandbox_kernel.guest.runner.client", "sandbox_kernel.guest.agent.agent"} <= names


@pytest.mark.parametrize("path", GUEST_MODULES, ids=lambda path: str(path.relative_to(GUEST)))
def test_a_guest_module_imports_only_the_standard_library_and_the_guest_package(path: Path) -> None:
    assert foreign_imports(path) == []


@pytest.mark.parametrize("path", GUEST_MODULES, ids=lambda path: str(path.relative_to(GUEST)))
def test_a_guest_module_is_python_3_8(path: Path) -> None:
    ast.parse(path.read_text(), str(path), feature_version=(3, 8))


@pytest.mark.parametrize("path", GUEST_MODULES, ids=lambda path: str(path.relative_to(GUEST)))
def test_a_guest_module_imports_as_a_package_module_on_the_host(path: Path) -> None:
    importlib.import_module(module_name(path))


def test_a_host_import_is_found_wherever_it_hides(tmp_path: Path) -> None:
    """The check itself: host imports, absolute or relative, at the top or in a function, and a
    third-party package are all reported; the guest's own imports and the stdlib's are not."""
    planted = tmp_path / "planted.py"
    planted.write_text("import os\nfrom .. import protocol\nfrom . import wire\nfrom .cells import Cell\n"
                       "def f():\n    from ...sandbox import session\n    import sandbox_kernel.config\n"
                       "    import httpx\n    from .... import elsewhere\n")
    assert foreign_imports(planted, "sandbox_kernel.guest.runner.planted") == [
        "planted.py:6: sandbox_kernel.sandbox", "planted.py:7: sandbox_kernel.config", "planted.py:8: httpx",
        "planted.py:9: ...."]


def test_every_guest_package_ships_in_the_wheel() -> None:
    """pyproject lists its packages one by one: a guest package missing there is missing from
    a wheel install, and so from every sandbox's upload."""
    pyproject = tomllib.loads((GUEST.parents[1] / "pyproject.toml").read_text())
    packages = {module_name(path) for path in GUEST.rglob("__init__.py")}
    assert packages <= set(pyproject["tool"]["setuptools"]["packages"])
