"""JupyterLab in a real browser: the kernel's HTML (the `%sandbox cost` table) shows its
prices as text; JupyterLab would typeset `$…$` in HTML output as LaTeX math (even written
`&#36;`: it reads the decoded text). A screenshot is kept in test-artifacts/jupyterlab-cost.png."""

from __future__ import annotations

import pytest

from browser_helpers import ARTIFACTS, Lab, lab_page_that_ran

pytestmark = [pytest.mark.slow, pytest.mark.browser]


def test_sandbox_cost_shows_dollars_not_math(jupyterlab: Lab, kernelspec: str) -> None:
    with lab_page_that_ran(jupyterlab, kernelspec, "%sandbox cost") as page:
        prices = page.locator(".jp-OutputArea-output tr", has_text="prices")
        prices.wait_for()
        page.wait_for_timeout(1000)  # give a math typesetter the time it would take
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "jupyterlab-cost.png"))
        text = prices.inner_text()
        assert "$0.03616363/vCPU-h running" in text and "$0.01159025/GiB-h" in text, text
        output = page.locator(".jp-OutputArea-output")
        assert output.locator("mjx-container, .MathJax, .katex").count() == 0
