"""JupyterLab and Chromium for the browser tests (tests/*_browser.py, tests/browser/test_browser.py).

One JupyterLab server serves every browser test of a run (the `jupyterlab` fixture in
conftest.py): starting one takes 5 to 10 s, more than most of these tests spend on their own
checks. Each test still gets a fresh Chromium and a workspace of its own, so no earlier Lab
state (open tabs, dialogs) leaks in; when it ends, its notebook and its kernels are gone, as
if the server had stopped. Chromium is Debian's `chromium` package (Playwright's own browser
downloads are never used), driven with Playwright.

Chromium is launched per test, not shared: between calls, Playwright's sync API leaves its
event loop marked as running in the thread, and the async tests that run between the browser
test files could not start theirs.
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
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import nbformat
import pytest

from engine_helpers import stop_process

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
TIMEOUT_MS = 60_000
NOTEBOOK = "demo.ipynb"


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


@dataclass(frozen=True)
class Lab:
    """A running JupyterLab server: its base URL, token and the folder it serves."""
    url: str
    token: str
    root: Path

    def end_sessions(self) -> None:
        """Shut down every notebook's kernel (the server waits for each kernel to stop)."""
        params = {"token": self.token}
        sessions = httpx.get(f"{self.url}/api/sessions", params=params, timeout=10)
        sessions.raise_for_status()
        for session in sessions.json():
            httpx.delete(f"{self.url}/api/sessions/{session['id']}", params=params,
                         timeout=60).raise_for_status()


@contextlib.contextmanager
def running_jupyterlab(settings: Path, extra_env: Mapping[str, str] | None = None) -> Iterator[Lab]:
    """JupyterLab serving `settings`/notebooks (made here) on loopback (random port, random
    token), its own state in `settings`, with `extra_env` added to this process's environment
    (its kernels inherit it)."""
    root = settings / "notebooks"
    root.mkdir(parents=True)
    token, port = secrets.token_hex(16), free_port()
    # Private settings and workspaces, so no Lab state from outside the test run leaks in.
    env = {**os.environ, **(extra_env or {}), "JUPYTERLAB_SETTINGS_DIR": str(settings / "settings"),
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
        yield Lab(url, token, root)
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
def lab_page_that_ran(lab: Lab, kernelspec: str, cell: str, run: bool = True) -> Iterator[Any]:
    """A Chromium page on JupyterLab with a one-cell notebook on the sandbox kernel, after
    running the cell (its outputs may still be arriving); with run false, before: the cell
    is selected, its kernel idle."""
    browser_path = chromium_path()
    from playwright.sync_api import sync_playwright

    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell)], metadata={
        "kernelspec": {"name": kernelspec, "display_name": "Python (sandbox)", "language": "python"}})
    nbformat.write(notebook, lab.root / NOTEBOOK)
    # A workspace Lab has not seen opens with this notebook alone, whatever earlier tests opened.
    workspace = f"test-{secrets.token_hex(4)}"
    url = f"{lab.url}/lab/workspaces/{workspace}/tree/{NOTEBOOK}?token={lab.token}"
    try:
        with sync_playwright() as playwright:
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
    finally:
        lab.end_sessions()
        (lab.root / NOTEBOOK).unlink()


def run_cell(page: Any, code: str) -> None:
    """Put `code` into the notebook's last cell and run it. Waits until the editor has the
    focus: in command mode (a notebook still settling after it opened) keys are JupyterLab's
    shortcuts ('x' cuts the cell, 'b' adds one) and the cell never runs. The code is inserted
    as a paste would be: typed, its newlines would meet the editor's auto-indent."""
    editor = page.locator(".jp-CodeCell .jp-InputArea-editor:visible").last
    editor.click()
    editor.locator(".cm-editor.cm-focused").wait_for()
    page.keyboard.press("Control+a")
    page.keyboard.insert_text(code)
    page.keyboard.press("Shift+Enter")


def output_with(page: Any, text: str) -> Any:
    """The last visible output holding `text`, once there is one."""
    output = page.locator(".jp-OutputArea-output:visible", has_text=text).last
    output.wait_for()
    return output


def screenshot(page: Any, name: str) -> None:
    """Into test-artifacts/ (docs/ has copies of some: panel.png and the others)."""
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / name))


# A slider whose observer, in the sandbox, prints into an Output widget shown under it.
SLIDER_CELL = """\
import ipywidgets as widgets
slider = widgets.IntSlider(value=3, min=0, max=10, description='n')
out = widgets.Output()

@out.capture()
def seen(change):
    print('the sandbox saw', change['new'])

slider.observe(seen, names='value')
display(slider, out)"""


def press_on_slider(page: Any, key: str, times: int) -> None:
    """Moves the (first) slider widget with the keyboard, as a user would after clicking its handle."""
    handle = page.locator(".jp-OutputArea-output .widget-slider .noUi-handle").first
    handle.focus()
    for _ in range(times):
        handle.press(key)
