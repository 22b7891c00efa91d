"""nbclient runs examples/quickstart.ipynb headless on the local engine; every output is checked."""

from __future__ import annotations

import base64
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import nbformat
import pytest
from nbclient import NotebookClient

from kernel_helpers import plain_traceback

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


class TimedClient(NotebookClient):
    """Records when each stream message arrives, to prove output streams during a cell."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stream_times: dict[int, list[float]] = {}

    def process_message(self, msg: dict, cell: Any, cell_index: int) -> Any:
        if msg["msg_type"] == "stream":
            self.stream_times.setdefault(cell_index, []).append(time.monotonic())
        return super().process_message(msg, cell, cell_index)


def visible(outputs: list[dict]) -> list[dict]:
    return [o for o in outputs if not o.get("metadata", {}).get("sandbox_kernel", {}).get("status")]


def stdout(outputs: list[dict]) -> str:
    return "".join(o["text"] for o in outputs if o["output_type"] == "stream" and o["name"] == "stdout")


def test_quickstart_notebook(kernelspec: str) -> None:
    nb = nbformat.read(EXAMPLES / "quickstart.ipynb", as_version=4)
    client = TimedClient(nb, kernel_name=kernelspec, timeout=120, startup_timeout=120)
    client.execute()
    cells = [c for c in nb.cells if c.cell_type == "code"]
    outs = [visible(c.outputs) for c in cells]

    # A saved notebook holds only what its code output: no kernel status line (nbclient
    # starts the kernel and waits for kernel_info, so the sandbox is up before the first cell).
    assert [c.outputs for c in cells] == outs
    assert stdout(outs[0]).startswith("Python ") and " in sandbox sb-" in stdout(outs[0])

    [total] = outs[1]
    assert total["output_type"] == "execute_result" and total["data"]["text/plain"] == "285"
    assert outs[2] == [{"output_type": "stream", "name": "stdout", "text": "mean square: 28.5\n"}]

    assert stdout(outs[3]) == "".join(f"step {i}\n" for i in range(5))
    streaming_index = nb.cells.index(cells[3])
    times = client.stream_times[streaming_index]
    # Five prints 0.4 s apart: the first arrived well before the last one was printed.
    assert times[-1] - times[0] > 1.0, "output was batched at the end of the cell"

    [html] = outs[4]
    assert html["output_type"] == "execute_result"
    assert html["data"]["text/html"].startswith("<table><tr><th>n</th><th>n²</th></tr><tr><td>0</td>")

    pngs = [o for o in outs[5] if o["output_type"] == "display_data" and "image/png" in o["data"]]
    assert len(pngs) == 1
    assert base64.b64decode(pngs[0]["data"]["image/png"]).startswith(b"\x89PNG")

    [error] = outs[6]
    assert (error["output_type"], error["ename"], error["evalue"]) == ("error", "KeyError", "'pears'")
    assert "inventory['pears']" in plain_traceback(error["traceback"])

    assert stdout(outs[7]) == "/workspace ['notes.txt']\n"


def test_headless_run_command_prints_the_notebook(kernelspec: str) -> None:
    """The README's first command: `sandbox-kernel run examples/quickstart.ipynb`."""
    result = subprocess.run(
        [sys.executable, "-m", "sandbox_kernel", "run", str(EXAMPLES / "quickstart.ipynb"),
         "--kernel", kernelspec], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "ready on" not in result.stdout
    for expected in ("285\n", "mean square: 28.5\n", "step 4\n",
                     "[image/png, ", "KeyError: 'pears'", "/workspace ['notes.txt']\n"):
        assert expected in result.stdout
