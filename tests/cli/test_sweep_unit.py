"""`sandbox-kernel sweep`'s plan, injected values, file names and summary, without kernels
(tests/e2e/test_sweep_cli.py runs sweeps for real)."""

from __future__ import annotations

import csv
import io

import nbformat
import pytest
from papermill.translators import PythonTranslator

from sandbox_kernel.cli.sweep import (
    SweepError,
    branch_notebook,
    csv_table,
    file_names,
    grid_of,
    html_table,
    parameter_source,
    plan,
    text_table,
)
from sandbox_kernel.sandbox.sweep import combinations, parse_value


def tagged(source: str, *tags: str) -> nbformat.NotebookNode:
    cell = nbformat.v4.new_code_cell(source)
    cell.metadata["tags"] = list(tags)
    return cell


def test_values_are_read_and_injected_as_papermill_does() -> None:
    values = ["3", "-2", "0.5", "1e-3", "True", "None", "a b", 'say "hi"\\n', "nan", "inf"]
    parameters = {f"p{index}": parse_value(value) for index, value in enumerate(values)}
    assert parameters["p0"] == 3 and parameters["p4"] is True and parameters["p5"] is None
    assert parameter_source(parameters) == PythonTranslator.codify(parameters)
    namespace: dict[str, object] = {}
    exec(parameter_source(parameters), namespace)  # noqa: S102 (our own literals)
    assert namespace["p7"] == 'say "hi"\\n' and namespace["p6"] == "a b"


def test_the_grid_is_the_product_of_the_values_in_order() -> None:
    branches = combinations(grid_of([["alpha", "1", "2"], ["mode", "x", "y", "z"]]))
    assert [branch.parameters for branch in branches][:4] == [
        {"alpha": 1, "mode": "x"}, {"alpha": 1, "mode": "y"}, {"alpha": 1, "mode": "z"}, {"alpha": 2, "mode": "x"}]
    assert len(branches) == 6 and branches[3].label == "alpha=2, mode='x'"


@pytest.mark.parametrize(("pairs", "message"), [
    ([], "give the parameters to sweep"),
    ([["alpha"]], "-p alpha: give at least one value"),
    ([["not-a-name", "1"]], "-p not-a-name: not a Python variable name"),
    ([["a", "1"], ["a", "2"]], "-p a: given twice"),
])
def test_bad_parameters_are_one_line(pairs: list[list[str]], message: str) -> None:
    with pytest.raises(SweepError, match=message):
        grid_of(pairs)


def test_the_fork_point_and_the_injected_cell() -> None:
    nb = nbformat.v4.new_notebook(cells=[tagged("setup = 1", "setup"), tagged("x = 0", "parameters"),
                                         tagged("x = 9", "injected-parameters"), tagged("print(x)")])
    nb.cells[0].outputs = [nbformat.v4.new_output("stream", text="stale")]
    template = plan(nb, None)
    assert (template.fork_at, template.inject_at, len(nb.cells)) == (1, 0, 3)  # an old injection goes
    assert nb.cells[0].outputs == []  # a saved output never passes for this run's
    executed = nbformat.from_dict(nbformat.v4.new_notebook(cells=nb.cells))
    executed.cells[0].outputs = [nbformat.v4.new_output("stream", text="ran")]
    branch = branch_notebook(executed, template, {"x": 5})
    assert [cell.source for cell in branch.cells] == ["setup = 1", "x = 0", "# Parameters\nx = 5\n", "print(x)"]
    assert branch.cells[0].outputs[0].text == "ran" and branch.metadata["papermill"]["parameters"] == {"x": 5}
    assert template.notebook.cells[2].source == "print(x)"  # the template is not changed

    early = plan(nbformat.v4.new_notebook(cells=[tagged("a = 1", "setup"), tagged("b = 2"),
                                                 tagged("x = 0", "parameters"), tagged("x")]), "setup")
    assert (early.fork_at, early.inject_at) == (0, 2)  # the values go right after the parameters cell
    with pytest.raises(SweepError, match="no cell is tagged 'parameters'"):
        plan(nbformat.v4.new_notebook(cells=[tagged("a = 1")]), None)
    with pytest.raises(SweepError, match="would run with the default values"):
        plan(nbformat.v4.new_notebook(cells=[tagged("x = 0", "parameters"), tagged("a", "late")]), "late")
    with pytest.raises(SweepError, match="--fork-after nope: no cell is tagged 'nope'"):
        plan(nbformat.v4.new_notebook(cells=[tagged("x = 0", "parameters")]), "nope")


def test_file_names_come_from_the_parameters_and_never_collide() -> None:
    branches = combinations({"path": ["a/b", "a_b"], "n": [1]})
    assert file_names("exp", branches) == ["exp-path=a_b-n=1.ipynb", "exp-path=a_b-n=1-1.ipynb"]


def test_values_from_a_sandbox_cannot_run_in_a_spreadsheet_a_terminal_or_a_page() -> None:
    header = ["#", "alpha", "status", "value"]
    rows = [["1", "-0.5", "ok", "=HYPERLINK(\"http://x\")"], ["2", "1", "ok", "\x1b]0;owned\x07<b>x</b>"]]
    read = list(csv.reader(io.StringIO(csv_table(header, rows))))
    assert read[1][1] == "-0.5" and read[1][3] == "'=HYPERLINK(\"http://x\")"
    printed = text_table(header, rows)
    assert "\x1b" not in printed and "\x07" not in printed and "\\x1b]0;owned\\x07" in printed
    page = html_table("sweep", header, rows)
    assert "<b>x</b>" not in page and "&lt;b&gt;x&lt;/b&gt;" in page
