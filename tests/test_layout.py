"""The package's folders say where code runs, and imports run one way (docs/architecture.md).

kernel -> sandbox -> api; local (the engine) is a server beside them; guest runs inside
sandboxes and imports nothing of the host (tests/guest/test_guest_imports.py checks it imports
only the standard library). Every import counts, also those inside functions.
"""
from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "sandbox_kernel"
# Modules directly in the package: shared by every host side.
FOUNDATION = {"__init__", "__main__", "config", "paths"}
# What each folder may import, besides itself and the standard library and third parties.
ALLOWED: dict[str, set[str]] = {
    "api": {"__init__"},
    "guest": set(),
    "local": {"__init__", "paths", "api", "guest"},
    "sandbox": {"__init__", "paths", "config", "api", "guest"},
    "kernel": {"__init__", "paths", "config", "api", "guest", "sandbox"},
    "cli": {"__init__", "paths", "config", "api", "guest", "sandbox", "kernel", "local"},
    # The Jupyter server extension behind the Sandboxes panel: host side, beside the kernel.
    "jupyter_panel": {"__init__", "paths", "config", "api", "sandbox"},
}
MAX_LINES = 1000  # one job per module: past this a module does several


def area_of(module: str) -> str:
    """'sandbox_kernel.sandbox.pool' -> 'sandbox'; 'sandbox_kernel.config' -> 'config';
    'sandbox_kernel' and 'sandbox_kernel.__version__' -> '__init__'."""
    parts = module.split(".")
    if len(parts) > 1 and (parts[1] in ALLOWED or parts[1] in FOUNDATION):
        return parts[1]
    return "__init__"


def imported_modules(source: str, own: str) -> set[str]:
    """The sandbox_kernel names the module `own` imports, relative imports resolved."""
    tree = ast.parse(source)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = own.split(".")[:-node.level]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] == "sandbox_kernel"}


def wrong_imports(area: str, imported: set[str]) -> list[str]:
    allowed = ALLOWED[area] | {area}
    return sorted(name for name in imported if area_of(name) not in allowed)


def package_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


@pytest.mark.parametrize("path", package_files(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_run_one_way(path: Path) -> None:
    area = area_of(module_name(path))
    if area in FOUNDATION:
        return
    wrong = wrong_imports(area, imported_modules(path.read_text(), module_name(path)))
    assert not wrong, f"{path.relative_to(PACKAGE)} ({area}) imports {wrong}"


def test_every_module_lives_in_a_folder_that_says_where_it_runs() -> None:
    loose = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert set(loose) <= FOUNDATION, f"modules outside the folders: {set(loose) - FOUNDATION}"
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders <= set(ALLOWED), folders - set(ALLOWED)


@pytest.mark.parametrize("path", package_files(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_does_several_jobs_by_length(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE)}: {lines} lines"


# Runs the command line when imported.
NOT_IMPORTABLE = {"sandbox_kernel.__main__"}
# Modules loaded by another package as it imports itself (an entry point), and that package.
LOADED_BY = {"sandbox_kernel.cli.papermill_engine": "papermill"}


@pytest.mark.parametrize("path", package_files(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_every_module_imports_and_so_does_each_import_in_its_functions(path: Path) -> None:
    """Imports deferred to where they are first used (to keep the kernel's start light) fail
    here, not in the first cell whose magic needs them."""
    name = module_name(path).removesuffix(".__init__")
    if name in NOT_IMPORTABLE:
        return
    if name in LOADED_BY:
        importlib.import_module(LOADED_BY[name])
    importlib.import_module(name)
    for inner in deferred_imports(ast.parse(path.read_text())):
        if isinstance(inner, ast.Import):
            for alias in inner.names:
                importlib.import_module(alias.name)
        elif inner.module and not inner.level:  # a relative one is of the package: imported above
            module = importlib.import_module(inner.module)
            for alias in inner.names:
                assert hasattr(module, alias.name) or importlib.import_module(f"{inner.module}.{alias.name}"), \
                    f"{name}: from {inner.module} import {alias.name}"


def deferred_imports(node: ast.AST, in_function: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """The imports in functions of the package's own modules and the standard library's, but
    for those in a try statement (optional by design). A third party's may need a set-up of
    its own first (debugpy's vendored _pydevd_bundle)."""
    if isinstance(node, ast.Try):
        return []
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        ours = all(name.split(".")[0] in {"sandbox_kernel", *sys.stdlib_module_names} for name in names)
        return [node] if in_function and ours else []
    inside = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    return [found for child in ast.iter_child_nodes(node) for found in deferred_imports(child, inside)]


def test_upward_imports_are_found_inside_functions_and_relative() -> None:
    source = "def f():\n    from ..kernel import handlers\n    import sandbox_kernel.sandbox.pool\n"
    imported = imported_modules(source, "sandbox_kernel.api.planted")
    assert wrong_imports("api", imported) == [
        "sandbox_kernel.kernel", "sandbox_kernel.kernel.handlers", "sandbox_kernel.sandbox.pool"]
    assert wrong_imports("cli", imported) == []
