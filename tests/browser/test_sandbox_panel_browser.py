"""The Sandboxes panel and its status bar item in JupyterLab, in a real browser.

JupyterLab and Chromium as in tests/test_widgets_browser.py (tests/browser_helpers.py); the
panel's server extension is the one `pip install` enabled. Every action is clicked in the
page, and its effect checked through the sandbox API (the engine), not through the panel.
Screenshots go to test-artifacts/ (docs/panel*.png are copies).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

from browser_helpers import Lab, lab_page_that_ran, output_with, run_cell, screenshot
from named_servers import FETCH, named_servers
from sandbox_kernel.api import NotFoundError, SandboxClient, SandboxView
from sandbox_kernel.api.local_engine import HOST_ALIAS
from sandbox_kernel.local.service import EngineEndpoint
from sandbox_kernel.sandbox import ownership

pytestmark = [pytest.mark.slow, pytest.mark.browser]

T = TypeVar("T")


def in_worker(work: Callable[[], T]) -> T:
    """Playwright's sync API keeps an event loop marked running in the test's thread: the
    API client's own loop runs in another."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(work).result()


def api_view(engine: EngineEndpoint, sandbox_id: str) -> SandboxView | None:
    async def get() -> SandboxView | None:
        async with SandboxClient(engine.url, engine.token) as client:
            try:
                return await client.get_sandbox(sandbox_id)
            except NotFoundError:
                return None
    return in_worker(lambda: asyncio.run(get()))


def api_views(engine: EngineEndpoint) -> list[SandboxView]:
    async def get() -> list[SandboxView]:
        async with SandboxClient(engine.url, engine.token) as client:
            return await client.list_sandboxes()
    return in_worker(lambda: asyncio.run(get()))


def wait_for_api(engine: EngineEndpoint, sandbox_id: str, status: str | None, page: Any) -> None:
    """Until the API reports `status` (None: gone) for the sandbox; the page's own clock
    paces it (a test asserts no duration: the browser tests' timeout bounds it)."""
    for _ in range(300):
        view = api_view(engine, sandbox_id)
        now = None if view is None or view.status.is_gone else view.status.value
        if now == status:
            return
        page.wait_for_timeout(200)
    raise AssertionError(f"the API never reported {sandbox_id} as {status}: last {now}")


def open_panel(page: Any) -> Any:
    """Open the panel as a user would: a click on the status bar item."""
    page.locator(".jp-SandboxStatus").wait_for()
    page.locator(".jp-SandboxStatus").click()
    panel = page.locator("#sandbox-kernel-panel")
    panel.locator(".jp-SandboxPanel-row.jp-mod-current").wait_for()
    return panel


def current_id(panel: Any) -> str:
    return panel.locator(".jp-SandboxPanel-row.jp-mod-current").get_attribute("data-sandbox-id")


def row(panel: Any, sandbox_id: str, **attributes: str) -> Any:
    selector = f".jp-SandboxPanel-row[data-sandbox-id='{sandbox_id}']" + "".join(
        f"[data-{name}='{value}']" for name, value in attributes.items())
    return panel.locator(selector)


def test_pause_resume_keep_from_the_panel_and_the_status_bar_follows(
        jupyterlab: Lab, kernelspec: str, engine: EngineEndpoint) -> None:
    with lab_page_that_ran(jupyterlab, kernelspec, "x = 41\nprint('ready', x)") as page:
        output_with(page, "ready 41")
        panel = open_panel(page)
        sandbox_id = current_id(panel)
        assert api_view(engine, sandbox_id).status.value == "running"
        mine = row(panel, sandbox_id)
        assert mine.locator(".jp-SandboxPanel-owner").inner_text() == "demo.ipynb"
        # CPU and memory now, as the kernel asks its sandbox (memory: of the shape's 1 GiB).
        mine.locator(".jp-SandboxPanel-usage", has_text=re.compile(r"CPU \d+% · memory \d+ of 1024 MiB")).wait_for()
        status = page.locator(".jp-SandboxStatus")
        status.locator("text=running").wait_for()
        screenshot(page, "panel.png")

        mine.locator("[data-action='pause']").click()
        wait_for_api(engine, sandbox_id, "paused", page)
        row(panel, sandbox_id, status="paused").wait_for()
        page.locator(".jp-SandboxStatus[data-status='paused']").wait_for()
        screenshot(page, "panel-statusbar-paused.png")

        # The next cell resumes the sandbox by itself; the status bar follows.
        run_cell(page, "print('again', x + 1)")
        output_with(page, "again 42")
        assert api_view(engine, sandbox_id).status.value == "running"
        page.locator(".jp-SandboxStatus[data-status='running']").wait_for()

        row(panel, sandbox_id, status="running").locator("[data-action='pause']").click()
        wait_for_api(engine, sandbox_id, "paused", page)
        row(panel, sandbox_id, status="paused").locator("[data-action='resume']").click()
        wait_for_api(engine, sandbox_id, "running", page)
        row(panel, sandbox_id, status="running").wait_for()

        assert not ownership.is_kept(sandbox_id)
        row(panel, sandbox_id).locator("[data-action='keep']").click()
        row(panel, sandbox_id).locator(".jp-SandboxPanel-owner[data-kind='kept']").wait_for()
        assert ownership.is_kept(sandbox_id)

        # A change made by a magic shows by itself (the panel and the status bar poll).
        run_cell(page, "%sandbox pause")
        wait_for_api(engine, sandbox_id, "paused", page)
        row(panel, sandbox_id, status="paused").wait_for()
        page.locator(".jp-SandboxStatus[data-status='paused']").wait_for()
    # Kept: the notebook's shutdown left it; the test destroys it.
    assert api_view(engine, sandbox_id).status.value == "paused"
    ownership.forget(sandbox_id)
    in_worker(lambda: asyncio.run(_destroy(engine, sandbox_id)))


async def _destroy(engine: EngineEndpoint, sandbox_id: str) -> None:
    async with SandboxClient(engine.url, engine.token) as client:
        await client.delete_sandbox(sandbox_id)


@pytest.fixture
def opened_notebooks(jupyterlab: Lab) -> Iterator[None]:
    """The notebooks "open in a new notebook" writes go with the test (lab_page_that_ran
    ends their sessions)."""
    yield
    for notebook in jupyterlab.root.glob("sandbox-*.ipynb"):
        notebook.unlink()


def test_a_fork_from_the_panel_opens_as_a_second_live_notebook_and_is_destroyed(
        jupyterlab: Lab, kernelspec: str, engine: EngineEndpoint, opened_notebooks: None) -> None:
    with lab_page_that_ran(jupyterlab, kernelspec, "x = 41\nprint('ready', x)") as page:
        output_with(page, "ready 41")
        panel = open_panel(page)
        source = current_id(panel)
        row(panel, source).locator("[data-action='fork']").click()
        dialog = page.locator(".jp-Dialog")
        dialog.locator("input").fill("panel-fork")
        dialog.locator(".jp-mod-accept").click()
        fork = panel.locator(".jp-SandboxPanel-row", has=page.locator(".jp-SandboxPanel-name", has_text="panel-fork"))
        fork.wait_for()
        fork_id = fork.get_attribute("data-sandbox-id")
        view = api_view(engine, fork_id)
        assert view is not None and view.forked_from == source and view.status.value == "running"
        assert api_view(engine, source).status.value == "paused"  # forks need a paused source

        fork.locator("[data-action='open']").click()
        page.locator(".lm-TabBar-tab.lm-mod-current", has_text="sandbox-panel-fork.ipynb").wait_for()
        # The new notebook's own toolbar names the kernel once it is on the fork's: until then
        # it says "No Kernel", and a cell run then has JupyterLab start a kernel of its own in
        # the session (a fresh sandbox; the fork's kernel is shut down), as for any notebook.
        page.locator(".jp-NotebookPanel-toolbar .jp-KernelName:visible", has_text="Python (sandbox)").wait_for()
        page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']:visible").wait_for()
        # The fork's Python state came with it: the new notebook sees the first one's x.
        run_cell(page, "print('fork sees', x)")
        output_with(page, "fork sees 41")
        assert [v.id for v in api_views(engine) if not v.status.is_gone and v.forked_from == source] == [fork_id]
        # Kept (no notebook's shutdown destroys it), its cells run from the new notebook.
        row(panel, fork_id).locator(".jp-SandboxPanel-owner[data-kind='kept']"
                                    "[title*='cells run from sandbox-panel-fork.ipynb']").wait_for()
        screenshot(page, "panel-fork.png")

        row(panel, fork_id).locator("[data-action='destroy']").click()
        page.locator(".jp-Dialog", has_text="Destroy panel-fork?").locator(".jp-mod-accept").click()
        wait_for_api(engine, fork_id, None, page)
        row(panel, fork_id).wait_for(state="detached")
        assert api_view(engine, source).status.value == "paused"


@pytest.fixture
def host_server() -> Iterator[int]:
    """An HTTP server on the host's loopback: the sandbox reaches it only with a rule."""
    with named_servers("hello from the host") as (port,):
        yield port



def test_a_refusal_allowed_from_the_panel_lets_the_next_request_through(
        jupyterlab: Lab, kernelspec: str, engine: EngineEndpoint, host_server: int) -> None:
    with lab_page_that_ran(jupyterlab, kernelspec, FETCH + f"print('first:', fetch({host_server}))") as page:
        output_with(page, "first: HTTP 403")
        panel = open_panel(page)
        network = panel.locator(".jp-SandboxPanel-network")
        refusal = network.locator(f".jp-SandboxPanel-refusal[data-target='{HOST_ALIAS}:{host_server}']").first
        refusal.wait_for()
        screenshot(page, "panel-network.png")
        refusal.locator("[data-action='allow']").click()
        network.locator(f".jp-SandboxPanel-rules[data-rules='{HOST_ALIAS}:{host_server}']").wait_for()

        run_cell(page, f"print('then:', fetch({host_server}))")
        output_with(page, "then: hello from the host")

        # The editor: a bad rule is refused with %egress's one line, block-all blocks.
        network.locator(".jp-SandboxPanel-rulesInput").fill("example.com 10.0.0.0/33")
        network.locator("[data-action='save-rules']").click()
        panel.locator(".jp-SandboxPanel-error", has_text="invalid egress rule '10.0.0.0/33'").wait_for()
        network.locator(f".jp-SandboxPanel-rules[data-rules='{HOST_ALIAS}:{host_server}']").wait_for()
        network.locator("[data-action='block-all']").click()
        network.locator(".jp-SandboxPanel-rules", has_text="all outbound connections blocked").wait_for()
        run_cell(page, f"print('blocked:', fetch({host_server}))")
        output_with(page, "blocked: HTTP 403")
