"""JupyterLab in a real browser: the kernel's HTML (the `%sandbox cost` table) shows its
prices as text; JupyterLab would typeset `$…$` in HTML output as LaTeX math (even written
`&#36;`: it reads the decoded text). A screenshot is kept in test-artifacts/jupyterlab-cost.png."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from test_browser import ARTIFACTS, TIMEOUT_MS, chromium_path, jupyterlab

pytestmark = pytest.mark.slow


def test_sandbox_cost_shows_dollars_not_math(kernelspec: str, tmp_path: Path) -> None:
    browser_path = chromium_path()
    from playwright.sync_api import sync_playwright

    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("%sandbox cost")], metadata={
        "kernelspec": {"name": kernelspec, "display_name": "Python (sandbox)", "language": "python"}})
    root = tmp_path / "notebooks"
    root.mkdir()
    nbformat.write(notebook, root / "demo.ipynb")  # the name jupyterlab() opens

    with jupyterlab(root, tmp_path) as url, sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=browser_path)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.set_default_timeout(TIMEOUT_MS)
            page.goto(url)
            page.locator(".jp-NotebookPanel-toolbar .jp-KernelName", has_text="Python (sandbox)").wait_for()
            page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").wait_for()
            page.locator(".jp-Cell .jp-InputArea-editor").first.click()
            page.keyboard.press("Shift+Enter")

            prices = page.locator(".jp-OutputArea-output tr", has_text="prices")
            prices.wait_for()
            page.wait_for_timeout(1000)  # give a math typesetter the time it would take
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "jupyterlab-cost.png"))
            text = prices.inner_text()
            assert "$0.03616363/vCPU-h running" in text and "$0.01159025/GiB-h" in text, text
            output = page.locator(".jp-OutputArea-output")
            assert output.locator("mjx-container, .MathJax, .katex").count() == 0
        finally:
            browser.close()
