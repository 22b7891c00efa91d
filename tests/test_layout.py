"""The package's folders say where code runs, and imports run one way (docs/architecture.md).

kernel -> sandbox -> api; local (the engine) is a server beside them; guest runs inside
sandboxes and imports nothing of the host (tests/guest/test_guest_imports.py checks it imports
only the standard library). Every import counts, also those inside functions.
"""
from __future__ import annotations

import ast
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


def test_upward_imports_are_found_inside_functions_and_relative() -> None:
    source = "def f():\n    from ..kernel import handlers\n    import sandbox_kernel.sandbox.pool\n"
    imported = imported_modules(source, "sandbox_kernel.api.planted")
    assert wrong_imports("api", imported) == [
        "sandbox_kernel.kernel", "sandbox_kernel.kernel.handlers", "sandbox_kernel.sandbox.pool"]
    assert wrong_imports("cli", imported) == []
