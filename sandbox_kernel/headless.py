"""`sandbox-kernel run NOTEBOOK`: execute a notebook headless in a sandbox and print it.

For terminals, CI jobs and agents: every code cell runs on the sandbox kernel (through
nbclient, as `jupyter execute` would) and its outputs are printed as text, images as a
one-line placeholder. Cells tagged `raises-exception` may fail; any other error stops
the run with exit status 1.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, TextIO

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


def run_notebook(path: Path, kernel_name: str, output: Path | None, timeout: float) -> int:
    try:
        import nbformat
        from nbclient import NotebookClient
        from nbclient.exceptions import CellExecutionError
    except ImportError:
        print("sandbox-kernel run needs nbclient: pip install 'sandbox-kernel[examples]'", file=sys.stderr)
        return 2
    from jupyter_client.kernelspec import NoSuchKernel

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, kernel_name=kernel_name, timeout=timeout, startup_timeout=timeout,
                            resources={"metadata": {"path": str(path.parent)}})
    status = 0
    try:
        client.execute()
    except NoSuchKernel:
        print(f"sandbox-kernel: no kernelspec {kernel_name!r}: run `sandbox-kernel install` first",
              file=sys.stderr)
        return 2
    except CellExecutionError:
        status = 1
    print_notebook(nb, sys.stdout)
    if output:
        nbformat.write(nb, output)
        print(f"executed notebook written to {output}")
    return status
