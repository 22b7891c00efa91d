"""The example notebooks run headless (papermill, as a user would) on the sandbox kernel;
their outputs are checked.

egress-lockdown installs a package from a package index this test serves on the host's
loopback (built here from a wheel made on the spot), so it needs no internet.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nbformat
import papermill
import pytest

from package_index import PACKAGE, serving_index

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(name: str, tmp_path: Path, kernel: str, **parameters: Any) -> list[str]:
    """Execute examples/NAME with papermill; return each code cell's visible text output."""
    output = tmp_path / name
    papermill.execute_notebook(str(EXAMPLES / name), str(output), parameters=parameters,
                               kernel_name=kernel, cwd=str(tmp_path), progress_bar=False,
                               execution_timeout=180, start_timeout=120)
    nb = nbformat.read(output, as_version=4)
    return [cell_text(cell) for cell in nb.cells if cell.cell_type == "code"]


def cell_text(cell: Any) -> str:
    """stdout, stderr and text/plain of a cell's outputs, in order."""
    parts = []
    for output in cell.outputs:
        if output.output_type == "stream":
            parts.append(output.text)
        elif output.output_type in ("display_data", "execute_result"):
            parts.append(output.data.get("text/plain", "") + "\n")
        elif output.output_type == "error":
            parts.append(f"{output.ename}: {output.evalue}\n")
    return "".join(parts)


def test_fork_explore(kernelspec: str, tmp_path: Path) -> None:
    build, fork, approach_a, approach_b, back_to_a, cleanup = run_example(
        "fork-explore.ipynb", tmp_path, kernelspec)
    fingerprint = build.split("fingerprint ")[1].split()[0]
    assert "ready on" not in build and "200 points" in build
    assert fork.count("Forked sb-") == 2 and "(approach-a)" in fork and "(approach-b)" in fork
    # Each fork has the data the original built, without recomputing it.
    assert f"fingerprint {fingerprint} (same data" in approach_a
    assert "Destroyed the previous sandbox" in approach_a
    assert "least squares: slope 3.0" in approach_a
    # B does not see A's work, and finds a slope closer to the truth despite the outliers.
    assert "False\nTheil-Sen: slope 3.0" in approach_b
    assert "least squares: slope 3.0" in back_to_a
    slope = {name: float(text.split(": slope ")[1].split()[0])
             for name, text in (("a", approach_a), ("b", approach_b))}
    assert abs(slope["b"] - 3) < abs(slope["a"] - 3)
    # Cleaned up: only approach B is left, and closing the notebook destroys it.
    assert "will be destroyed" in cleanup
    assert cleanup.count("(this notebook)") == 1 and "forked from sb-" in cleanup


def test_pause_resume(kernelspec: str, tmp_path: Path) -> None:
    step1, paused, step2, pause_resume, cost = run_example("pause-resume.ipynb", tmp_path, kernelspec)
    assert "step 1 done: 399 factorials" in step1
    assert " paused (" in paused and "state        paused" in paused
    assert "was paused: resuming" in step2 and "step 2 done: 156411 digits" in step2
    assert " paused (" in pause_resume and " running again (" in pause_resume
    assert "(this notebook)" in cost and "running " in cost and "paused " in cost
    assert "CreateOS, 2026-10-17" in cost


def test_agent_tool(kernelspec: str, tmp_path: Path) -> None:
    """Runs on the plain python3 kernel, which drives a sandbox kernel through jupyter_client."""
    (_, _, _, first, state, error, runaway, host_file, _) = run_example(
        "agent-tool.ipynb", tmp_path, "python3", kernel_name=kernelspec)
    assert "'stdout': 'running in sb-" in first
    assert "'result': '4'" in state
    assert "'error': 'ZeroDivisionError: division by zero'" in error
    assert "'error': 'stopped after 3 s'" in runaway and "'result': '8'" in runaway, runaway
    assert "'stdout': 'False /workspace\\n'" in host_file


@pytest.fixture
def package_index(tmp_path: Path) -> Iterator[str]:
    with serving_index(tmp_path / "index") as url:
        yield url


def test_egress_lockdown(kernelspec: str, tmp_path: Path, package_index: str) -> None:
    (parameters, injected, lockdown, install, blocked, report, block_all) = run_example(
        "egress-lockdown.ipynb", tmp_path, kernelspec, index_url=package_index, package=PACKAGE)
    assert "egress: only 127.0.0.1" in lockdown
    assert "Successfully installed hello-sandbox-1.0" in install and "imported hello_sandbox" in install
    assert "refused: 403 Forbidden" in blocked and "no rule allows 203.0.113.10:80" in blocked
    assert "only 127.0.0.1" in report and "refused   1 connection(s)" in report
    assert "203.0.113.10:80" in report
    assert "all outbound connections blocked" in block_all


def test_egress_lockdown_without_an_index(kernelspec: str, tmp_path: Path) -> None:
    """The defaults work offline: the install is skipped, the refusal still shown."""
    texts = run_example("egress-lockdown.ipynb", tmp_path, kernelspec)
    assert "install step skipped" in texts[2] and "refused: 403 Forbidden" in texts[3]


def test_sweep(kernelspec: str, tmp_path: Path) -> None:
    setup, swept, source = run_example("sweep.ipynb", tmp_path, kernelspec)
    assert "200000 noisy samples ready" in setup
    # papermill's client has no widget manager: the progress is the text line, then the table.
    assert "Swept 5 branch(es) over forks of sb-" in swept and "every fork destroyed" in swept
    rows = {row.split(None, 1)[0]: row.split()[1:] for row in swept.splitlines() if row.startswith("window=")}
    assert list(rows) == [f"window={window}" for window in (0, 1, 11, 101, 1001)], swept
    assert rows["window=0"][:2] == ["failed", "ZeroDivisionError:"]
    errors = {window: float(rows[f"window={window}"][1]) for window in (1, 11, 101, 1001)
              if rows[f"window={window}"][0] == "ok"}
    assert len(errors) == 4, swept
    # The noise shrinks as the window grows, until the window flattens the sine itself.
    assert errors[1] > errors[11] > errors[101] < errors[1001]
    assert "False 200000" in source  # the branches' values never reached the notebook's sandbox
