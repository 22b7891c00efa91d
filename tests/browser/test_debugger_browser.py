"""The JupyterLab debugger in a real browser, on code running in the sandbox.

JupyterLab and Chromium as in tests/browser/test_browser.py (tests/browser_helpers.py). The user
switches the debugger on in the notebook's toolbar, clicks the gutter of a cell's line to set
a breakpoint and runs the cell: it stops there, in the sandbox, and the debugger panel shows
the cell's variables. The screenshot is kept in test-artifacts/.
"""

from __future__ import annotations

import pytest

from browser_helpers import ARTIFACTS, Lab, lab_page_that_ran

pytestmark = [pytest.mark.slow, pytest.mark.browser]

CELL = """\
def add(a, b):
    total = a + b
    return total

add(20, 22)"""
BREAKPOINT_LINE = 2


def test_the_debugger_stops_a_sandboxed_cell_at_a_breakpoint_and_shows_its_variables(
        jupyterlab: Lab, kernelspec: str) -> None:
    with lab_page_that_ran(jupyterlab, kernelspec, CELL, run=False) as page:
        page.locator(".jp-DebuggerBugButton").first.click()
        page.locator(".jp-DebuggerBugButton[aria-pressed='true']").first.wait_for()
        gutter = page.locator(".jp-Cell .cm-breakpoint-gutter .cm-gutterElement")
        gutter.nth(BREAKPOINT_LINE).click()  # the first element is the gutter's spacer
        # Listed once the kernel has answered setBreakpoints (a cell run before would not stop).
        page.locator(".jp-DebuggerBreakpoints .jp-DebuggerBreakpoint").first.wait_for()
        page.locator(".jp-Cell .jp-InputArea-editor").first.click()
        page.keyboard.press("Shift+Enter")
        variables = page.locator(".jp-DebuggerVariables-body")
        try:
            variables.locator(".jp-DebuggerVariables-name", has_text="a").first.wait_for()
            variables.get_by_text("20").first.wait_for()
            variables.get_by_text("22").first.wait_for()
        finally:
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "debugger-breakpoint.png"))
        # Stopped: the cell has not finished (its result is not shown yet).
        assert page.locator(".jp-OutputArea-output", has_text="42").count() == 0
