"""JupyterLab in a real browser: a notebook on the sandbox kernel prints and plots.

Debian's Chromium, driven with Playwright, on JupyterLab served on loopback (random port,
random token), as tests/browser_helpers.py describes. The test opens a notebook saved with
the sandbox kernel, runs its cell, and checks that the text and the plot are rendered. A
screenshot is kept in test-artifacts/.
"""

from __future__ import annotations

import pytest

from browser_helpers import ARTIFACTS, Lab, lab_page_that_ran

pytestmark = [pytest.mark.slow, pytest.mark.browser]

CELL = """\
import os
import matplotlib.pyplot as plt
print('hello from', os.environ.get('SANDBOX_ID'))
plt.plot([1, 4, 9, 16, 25], marker='o')
plt.title('plotted inside the sandbox')
plt.show()"""


def test_jupyterlab_runs_a_cell_that_prints_and_plots(jupyterlab: Lab, kernelspec: str) -> None:
    with lab_page_that_ran(jupyterlab, kernelspec, CELL) as page:
        output = page.locator(".jp-OutputArea-output")
        output.get_by_text("hello from sb-").wait_for()
        plot = output.locator("img")
        plot.wait_for()
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "jupyterlab-sandbox.png"))
        assert output.get_by_text("ready on").count() == 0  # no kernel status line in the cell
        # The browser decoded a real image, not a broken placeholder.
        assert plot.evaluate("img => img.naturalWidth") > 100
