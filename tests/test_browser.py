"""JupyterLab in a real browser: a notebook on the sandbox kernel prints and plots.

The test starts JupyterLab on loopback (random port, random token) and drives the system's
Chromium (Debian's `chromium` package; Playwright's own browser downloads are never used)
with Playwright. It opens a notebook saved with the sandbox kernel, runs its cell, and checks
that the text and the plot are rendered. A screenshot is kept in test-artifacts/.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import nbformat
import pytest

from engine_helpers import stop_process

pytestmark = [pytest.mark.slow, pytest.mark.browser]

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
CELL = """\
import os
import matplotlib.pyplot as plt
print('hello from', os.environ.get('SANDBOX_ID'))
plt.plot([1, 4, 9, 16, 25], marker='o')
plt.title('plotted inside the sandbox')
plt.show()"""
TIMEOUT_MS = 60_000


def chromium_path() -> str:
    """Debian's chromium, or skip with the reason (CI installs it; see .ci/run)."""
    for candidate in ("chromium", "chromium-browser"):
        path = shutil.which(candidate)
        if path:
            return path
    pytest.skip("no chromium browser on this machine (Debian: apt-get install chromium)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def jupyterlab(root: Path, settings: Path) -> Iterator[str]:
    """JupyterLab serving `root` on loopback; yields its base URL with the token."""
    token, port = secrets.token_hex(16), free_port()
    # Private settings and workspaces, so no earlier Lab state (open tabs, dialogs) leaks in.
    env = {**os.environ, "JUPYTERLAB_SETTINGS_DIR": str(settings / "settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(settings / "workspaces")}
    # Don't ask about Jupyter news: the question would cover the notebook in the screenshot.
    notification = settings / "settings" / "@jupyterlab" / "apputils-extension"
    notification.mkdir(parents=True)
    (notification / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')
    log = (settings / "jupyterlab.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root",
         "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
        env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(url, token, server)
        yield f"{url}/lab/tree/demo.ipynb?token={token}"
    finally:
        stop_process(server, 20)
        log.close()


def wait_until_up(url: str, token: str, server: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert server.poll() is None, "JupyterLab exited during start-up (see jupyterlab.log)"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/api/status", params={"token": token}, timeout=2).status_code == 200:
                return
        time.sleep(0.3)
    raise AssertionError("JupyterLab did not answer within 60 s")


@contextlib.contextmanager
def lab_page_that_ran(kernelspec: str, tmp_path: Path, cell: str, run: bool = True) -> Iterator[Any]:
    """A Chromium page on JupyterLab with a one-cell notebook on the sandbox kernel, after
    running the cell (its outputs may still be arriving); with run false, before: the cell
    is selected, its kernel idle."""
    browser_path = chromium_path()
    from playwright.sync_api import sync_playwright

    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell)], metadata={
        "kernelspec": {"name": kernelspec, "display_name": "Python (sandbox)", "language": "python"}})
    root = tmp_path / "notebooks"
    root.mkdir()
    nbformat.write(notebook, root / "demo.ipynb")

    with jupyterlab(root, tmp_path) as url, sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=browser_path)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.set_default_timeout(TIMEOUT_MS)
            page.goto(url)
            # The notebook opens on its saved kernel; wait until that kernel is idle.
            page.locator(".jp-NotebookPanel-toolbar .jp-KernelName", has_text="Python (sandbox)").wait_for()
            page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").wait_for()
            page.locator(".jp-Cell .jp-InputArea-editor").first.click()
            if run:
                page.keyboard.press("Shift+Enter")
            yield page
        finally:
            browser.close()


def test_jupyterlab_runs_a_cell_that_prints_and_plots(kernelspec: str, tmp_path: Path) -> None:
    with lab_page_that_ran(kernelspec, tmp_path, CELL) as page:
        output = page.locator(".jp-OutputArea-output")
        output.get_by_text("hello from sb-").wait_for()
        plot = output.locator("img")
        plot.wait_for()
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "jupyterlab-sandbox.png"))
        assert output.get_by_text("ready on").count() == 0  # no kernel status line in the cell
        # The browser decoded a real image, not a broken placeholder.
        assert plot.evaluate("img => img.naturalWidth") > 100
