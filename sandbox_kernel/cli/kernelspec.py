"""Installing the "Python (sandbox)" kernelspec where `jupyter kernelspec list` finds it."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from importlib.resources import files
from typing import TYPE_CHECKING
from pathlib import Path

from jupyter_client.kernelspec import KernelSpecManager

if TYPE_CHECKING:  # importlib.resources.abc is 3.11+; annotations only
    from importlib.resources.abc import Traversable

SPEC_FILES = ("kernel.json", "logo-32x32.png", "logo-64x64.png")


def spec_source() -> Traversable:
    """The kernelspec/ folder: beside the package in a source checkout, inside it in a wheel."""
    checkout = Path(__file__).resolve().parents[2] / "kernelspec"
    if (checkout / "kernel.json").is_file():
        return checkout
    return files("sandbox_kernel.kernelspec_files")


def install(name: str = "sandbox", sys_prefix: bool = False, prefix: str | None = None,
            env: dict[str, str] | None = None, display_name: str | None = None) -> str:
    """Install the kernelspec (per user unless sys_prefix or prefix is given); return its dir.

    `env` is set for the kernel (provider, shape, egress...); never pass a key here: a
    kernelspec is a plain file, and the kernel reads CREATEOS_SANDBOX_API_KEY from the
    environment it is started in.
    """
    source = spec_source()
    with tempfile.TemporaryDirectory() as tmp:
        for filename in SPEC_FILES:
            with (source / filename).open("rb") as src, open(Path(tmp) / filename, "wb") as dst:
                shutil.copyfileobj(src, dst)
        spec_path = Path(tmp) / "kernel.json"
        spec = json.loads(spec_path.read_text())
        # The kernel must run with the Python that has sandbox_kernel installed.
        spec["argv"][0] = sys.executable
        if env:
            spec["env"] = env
        if display_name:
            spec["display_name"] = display_name
        spec_path.write_text(json.dumps(spec, indent=2) + "\n")
        if sys_prefix:
            prefix = sys.prefix
        return KernelSpecManager().install_kernel_spec(
            tmp, kernel_name=name, user=not prefix, prefix=prefix)
