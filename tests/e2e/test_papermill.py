"""papermill's command line on the sandbox kernel: the parameters cell is injected, and the
values are used by code running inside the sandbox."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.one_path]


def test_papermill_injects_parameters(kernelspec: str, tmp_path: Path) -> None:
    parameters = nbformat.v4.new_code_cell("rows = 2\nlabel = 'default'")
    parameters.metadata["tags"] = ["parameters"]
    notebook = nbformat.v4.new_notebook(cells=[
        parameters,
        nbformat.v4.new_code_cell("import os\nprint(os.getcwd(), [label] * rows)"),
    ], metadata={"kernelspec": {"name": kernelspec, "display_name": "Python (sandbox)",
                                "language": "python"}})
    source, output = tmp_path / "params.ipynb", tmp_path / "out.ipynb"
    nbformat.write(notebook, source)

    result = subprocess.run(
        [sys.executable, "-m", "papermill", str(source), str(output), "-p", "rows", "3",
         "-p", "label", "from papermill", "--no-progress-bar"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr

    cells = nbformat.read(output, as_version=4).cells
    injected = cells[1]
    assert injected.metadata["tags"] == ["injected-parameters"]
    assert "rows = 3" in injected.source and 'label = "from papermill"' in injected.source
    printed = "".join(o.get("text", "") for o in cells[2].outputs if o.output_type == "stream")
    # /workspace: the cell ran in the sandbox, with the injected values.
    assert printed == "/workspace ['from papermill', 'from papermill', 'from papermill']\n"
