"""The first hour in JupyterLab in a real browser (issue 36), with what the tour installs
(`.[examples]`: ipywidgets, tqdm, jupyter-resource-usage).

One notebook walks a newcomer's steps: the kernel usage panel shows the sandbox's numbers, a
slider's observer runs in the sandbox, `%egress allow pypi` then a plain `%pip install` work on
the first try from the index pip on this machine uses (a local one), a refused urllib call is
named after its cell, and `%sandbox list` shows the kept sandbox. Screenshot:
test-artifacts/jupyterlab-first-hour.png.

Also: the kernel's HTML (the `%sandbox cost` table) shows its prices as text; JupyterLab would
typeset `$…$` in HTML output as LaTeX math (even written `&#36;`: it reads the decoded text).
Screenshot: test-artifacts/jupyterlab-cost.png.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from browser_helpers import (SLIDER_CELL, Lab, chromium_path, lab_page_that_ran, output_with,
                             press_on_slider, run_cell, running_jupyterlab, screenshot)
from cli_helpers import cli
from package_index import PACKAGE, serving_index
from sandbox_kernel.api.local_engine import HOST_ALIAS

pytestmark = [pytest.mark.slow, pytest.mark.browser]

STDERR = ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']"
WHERE = "import os, socket\nprint('sandbox', socket.gethostname(), os.getpid())"
REFUSED_PORT = 9  # nothing listens there: the proxy refuses before connecting anyway
FETCH_REFUSED = f"""\
import urllib.request
try:
    urllib.request.urlopen('http://{HOST_ALIAS}:{REFUSED_PORT}/', timeout=10)
except OSError as exc:
    print('urllib says:', exc)"""


def test_sandbox_cost_shows_dollars_not_math(jupyterlab: Lab, kernelspec: str) -> None:
    with lab_page_that_ran(jupyterlab, kernelspec, "%sandbox cost") as page:
        prices = page.locator(".jp-OutputArea-output tr", has_text="prices")
        prices.wait_for()
        page.wait_for_timeout(1000)  # give a math typesetter the time it would take
        screenshot(page, "jupyterlab-cost.png")
        text = prices.inner_text()
        assert "$0.03616363/vCPU-h running" in text and "$0.01159025/GiB-h" in text, text
        output = page.locator(".jp-OutputArea-output")
        assert output.locator("mjx-container, .MathJax, .katex").count() == 0


@pytest.fixture
def lab_with_an_index(kernelspec: str, tmp_path: Path) -> Iterator[tuple[Lab, str]]:
    """JupyterLab started where pip uses a company index (PIP_INDEX_URL, here an index on this
    host's loopback), which its kernels inherit; yields it with the index's port. This
    machine's own pip configuration files stay out of it."""
    chromium_path()
    with serving_index(tmp_path / "index") as alias_url:
        host_url = alias_url.replace(HOST_ALIAS, "127.0.0.1")  # as the host's pip knows it
        port = str(urlsplit(host_url).port)
        with running_jupyterlab(tmp_path / "lab", {"PIP_INDEX_URL": host_url, "PIP_CONFIG_FILE": os.devnull}) as lab:
            yield lab, port


def test_the_first_hour_walk(lab_with_an_index: tuple[Lab, str], kernelspec: str) -> None:
    lab, index_port = lab_with_an_index
    kept: str | None = None
    try:
        with lab_page_that_ran(lab, kernelspec, WHERE) as page:
            where = output_with(page, "sandbox ").inner_text().split()
            hostname, pid = where[1], where[2]

            # The kernel usage panel (the right sidebar's gauge, as the README says): the
            # sandbox's Python, its numbers filled.
            page.locator(".jp-SideBar.jp-mod-right [data-id='kernelusage-panel-id']").click()
            usage = page.locator("#kernelusage-panel-id")
            usage.locator(".jp-KernelUsage-separator", has_text=f"Kernel Host: {hostname}").wait_for()
            usage.locator(".jp-KernelUsage-separator", has_text=f"Process ID: {pid}").wait_for()
            usage.locator(".jp-KernelUsage-separator",
                          has_text=re.compile(r"^Memory: \d+(\.\d+)? [KMG]B$")).wait_for()
            usage.locator(".jp-KernelUsage-separator", has_text=re.compile(r"^CPU: \d")).wait_for()

            # A slider moved in the page: its observer runs in the sandbox and prints under it.
            run_cell(page, SLIDER_CELL)
            output = page.locator(".jp-OutputArea-output")
            output.locator(".widget-slider .widget-readout", has_text="3").wait_for()
            press_on_slider(page, "ArrowRight", 2)
            output.locator(".widget-output", has_text="the sandbox saw 5").wait_for()

            # One preset, then a plain %pip install: the first try works.
            run_cell(page, "%egress allow pypi")
            output_with(page, f"egress: only 127.0.0.1:{index_port} (was: all public destinations")
            run_cell(page, f"%pip install {PACKAGE}")
            output_with(page, f"Successfully installed {PACKAGE}-1.0")
            run_cell(page, "import hello_sandbox\nprint(hello_sandbox.GREETING)")
            output_with(page, "installed from the host index")
            assert page.locator(STDERR, has_text="egress refused").count() == 0, "pip met no refusal"

            # urllib says only 403; the kernel's line after the cell names the destination and why.
            run_cell(page, FETCH_REFUSED)
            output_with(page, "urllib says: HTTP Error 403")
            destination = f"{HOST_ALIAS}:{REFUSED_PORT}"
            refused = page.locator(STDERR, has_text=f"sandbox-kernel: egress refused {destination}: ").last
            refused.wait_for()
            assert f"no rule allows {destination}" in refused.inner_text()

            # What outlives the notebook, shown where the user is.
            run_cell(page, "%sandbox keep")
            kept = re.search(r"Sandbox (\S+) \(.+\) is kept", output_with(page, "is kept").inner_text())[1]
            run_cell(page, "%sandbox list")
            output_with(page, f"KEPT: outlives its notebook (sandbox-kernel rm {kept} destroys it)")
            screenshot(page, "jupyterlab-first-hour.png")
    finally:
        if kept:  # the notebook's shutdown left it, as kept ones are: removed as the line says
            removed = cli("rm", kept)
            assert removed.returncode == 0, removed.stderr
