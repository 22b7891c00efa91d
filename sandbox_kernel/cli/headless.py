"""`sandbox-kernel run NOTEBOOK`: execute a notebook headless in a sandbox and print it.

For terminals, CI jobs and agents: every code cell runs on the sandbox kernel (through
nbclient, as `jupyter execute` would) and its outputs are printed as text, images as a
one-line placeholder. Cells tagged `raises-exception` may fail; any other error stops
the run (or, with allow_errors, is noted and the run goes on) with exit status 1. The last
line sums up: how many cells ran, which failed, how long it took. A notebook sealed by its
metadata (sealed.py) runs with exactly the sandbox its metadata says, or not at all.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path
from collections.abc import Collection
from typing import Any, TextIO

from sandbox_kernel.sandbox.sealed import allowed_env, kernel_arguments

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def describe_output(output: dict[str, Any]) -> str:
    kind = output["output_type"]
    if kind == "stream":
        return output["text"]
    if kind == "error":
        return ANSI.sub("", "\n".join(output["traceback"])) + "\n"
    data = output.get("data", {})
    images = [mime for mime in data if mime.startswith("image/")]
    if images:
        return f"[{images[0]}, {len(data[images[0]]) * 3 // 4 // 1024} KiB]\n"
    if "text/plain" in data:
        return data["text/plain"] + "\n"
    return f"[{', '.join(data) or 'empty output'}]\n"


def print_notebook(nb: Any, out: TextIO) -> None:
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        count = cell.get("execution_count") or " "
        out.write(f"In [{count}]: " + cell.source.replace("\n", "\n        ") + "\n")
        for output in cell.get("outputs", []):
            out.write(describe_output(output))
        out.write("\n")


def summary(nb: Any, seconds: float, stopped_by: str | None = None) -> tuple[str, bool]:
    """The closing line, and whether a cell failed that was not expected to. stopped_by:
    the error that stopped the run (a kernel error, such as a bad magic, has no error output)."""
    code = [cell for cell in nb.cells if cell.cell_type == "code" and cell.source.strip()]
    ran = [cell for cell in code if cell.get("execution_count")]  # cleared before the run
    failed = [f"In [{cell.execution_count}] ({output['ename']})" for cell in ran
              for output in cell.get("outputs", [])
              if output["output_type"] == "error" and "raises-exception" not in cell.metadata.get("tags", [])]
    if stopped_by and not failed and ran:
        failed = [f"In [{ran[-1].execution_count}] ({stopped_by})"]
    line = f"ran {len(ran)} of {len(code)} code cells in {seconds:.1f} s"
    return (line + f"; failed: {', '.join(failed)}" if failed else line + ", no errors"), bool(failed)


def run_notebook(path: Path, kernel_name: str, output: Path | None, timeout: float,
                 allow_errors: bool = False, allow_env: Collection[str] = ()) -> int:
    try:
        import nbformat
        from nbclient import NotebookClient
        from nbclient.exceptions import CellExecutionError
    except ImportError:
        print("sandbox-kernel run needs nbclient: pip install 'sandbox-kernel[examples]'", file=sys.stderr)
        return 2
    from jupyter_client.kernelspec import NoSuchKernel

    nb = nbformat.read(path, as_version=4)
    # Before any kernel starts: a seal that cannot be applied refuses the run (SealError).
    sealed = kernel_arguments(nb.metadata, allowed_env(allow_env))
    for cell in nb.cells:  # outputs saved in the file must not pass for this run's
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    client = NotebookClient(nb, kernel_name=kernel_name, timeout=timeout, startup_timeout=timeout,
                            allow_errors=allow_errors, resources={"metadata": {"path": str(path.parent)}},
                            extra_arguments=sealed)
    started = time.monotonic()
    stopped_by = None
    try:
        client.execute()
    except NoSuchKernel:
        print(f"sandbox-kernel: no kernelspec {kernel_name!r}: run `sandbox-kernel install` first",
              file=sys.stderr)
        return 2
    except CellExecutionError as exc:
        stopped_by = exc.ename or "error"  # the summary names the cell
    print_notebook(nb, sys.stdout)
    if output:
        nbformat.write(nb, output)
        print(f"executed notebook written to {output}")
    line, failed = summary(nb, time.monotonic() - started, stopped_by)
    print(line)
    return 1 if failed else 0
