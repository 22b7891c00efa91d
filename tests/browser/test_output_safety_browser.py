"""The output filter in a real browser: Chromium's own HTML parser, and JupyterLab itself.

First the attack strings of tests/support/output_attacks.py, put into a page as JupyterLab puts a
fresh output (innerHTML, then its scripts re-created so that they run): unfiltered, those that
fire unaided do set the page's marker; filtered, none does. Then a notebook on the sandbox
kernel in JupyterLab (tests/browser_helpers.py): a cell displays a Javascript object, HTML with
a script, an image with an onerror handler, an HTML widget with one and an Output widget with
Javascript, each of which would set a marker in the page and write a file through the Jupyter
server's API with the page's token; beside them, everyday output. The attacks are displayed,
no marker is set, no file is written, and the plot, the table, the slider and the tqdm bar
render. With `%sandbox trust-output on` the same Javascript does run (the test can see it).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from browser_helpers import ARTIFACTS, Lab, chromium_path, lab_page_that_ran
from output_attacks import FIRES_UNAIDED, NOT_UNAIDED
from sandbox_kernel.kernel.safe_html import safe_html

pytestmark = [pytest.mark.slow, pytest.mark.browser]

# As JupyterLab renders a trusted text/html output (renderHTML: innerHTML, then
# evalInnerHTMLScriptTags); true if the page's marker was set.
INSERT_AS_JUPYTERLAB_DOES = """async (markup) => {
  window.__pwned = undefined;
  const host = document.createElement('div');
  document.body.appendChild(host);
  host.innerHTML = markup;
  for (const old of host.querySelectorAll('script')) {
    const script = document.createElement('script');
    for (const attribute of old.attributes) script.setAttribute(attribute.name, attribute.value);
    script.text = old.textContent;
    old.parentNode.replaceChild(script, old);
  }
  await new Promise(done => setTimeout(done, 300));  // handlers of failed loads, frames' scripts
  host.remove();
  return window.__pwned === 1;
}"""


@pytest.fixture
def blank_page() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path())
        try:
            page = browser.new_page()
            page.set_content("<!DOCTYPE html><html><body></body></html>")
            yield page
        finally:
            browser.close()


def test_chromium_runs_the_attacks_unfiltered_and_none_after_the_filter(blank_page: Any) -> None:
    fired = [attack for attack in FIRES_UNAIDED if blank_page.evaluate(INSERT_AS_JUPYTERLAB_DOES, attack)]
    assert fired == FIRES_UNAIDED  # each of these does run in the page when left as it is
    ran = [attack for attack in FIRES_UNAIDED + NOT_UNAIDED
           if blank_page.evaluate(INSERT_AS_JUPYTERLAB_DOES, safe_html(attack))]
    assert ran == []


def attack_js(name: str) -> str:
    """Sets the page's marker, then writes pwned-NAME.txt with the page's own Jupyter token."""
    return ("window.__pwned_%(name)s = 1;"
            "const c = JSON.parse(document.getElementById('jupyter-config-data').textContent);"
            "fetch(c.baseUrl + 'api/contents/pwned-%(name)s.txt', {method: 'PUT', headers: "
            "{'Authorization': 'token ' + c.token, 'Content-Type': 'application/json'}, body: JSON.stringify("
            "{type: 'file', format: 'text', content: 'pwned'})});") % {"name": name}


ATTACK_CELL = f"""\
import ipywidgets as widgets
from IPython.display import HTML, Javascript, display
import matplotlib.pyplot as plt, pandas as pd, time
from tqdm.auto import tqdm

display(Javascript({attack_js("javascript")!r}))
display(HTML('<b>html shown</b><script>' + {attack_js("script")!r} + '</script>'))
display(HTML('<img src=x onerror="' + {attack_js("onerror")!r} + '">'))
display(widgets.HTML(value='<b>widget shown</b><img src=x onerror="' + {attack_js("widget")!r} + '">'))
out = widgets.Output()
out.outputs = ({{'output_type': 'display_data', 'metadata': {{}},
                 'data': {{'application/javascript': {attack_js("output_widget")!r}, 'text/plain': 'output widget shown'}}}},)
display(out)
display(pd.DataFrame({{'city': ['Oslo', 'Lima'], 'rain': [763, 6]}}))
display(widgets.IntSlider(value=4, description='everyday'))
for _ in tqdm(range(5), desc='sandbox work'):
    time.sleep(0.02)
plt.plot([1, 2, 3]); plt.show()
print('attack cell ran')
"""

TRUSTED_CELL = f"""\
%sandbox trust-output on
from IPython.display import Javascript, display
display(Javascript({attack_js("trusted")!r}))
print('trusted cell ran')
"""


def markers(page: Any) -> list[str]:
    return page.evaluate("() => Object.keys(window).filter(key => key.startsWith('__pwned'))")


def test_jupyterlab_shows_the_attacks_without_running_them_and_everyday_output_renders(
        jupyterlab: Lab, kernelspec: str) -> None:
    with lab_page_that_ran(jupyterlab, kernelspec, ATTACK_CELL) as page:
        output = page.locator(".jp-OutputArea-output")
        output.get_by_text("attack cell ran").wait_for()
        # The attacks were displayed: as a note, inline, or in their isolated frames.
        output.get_by_text("application/javascript withheld").first.wait_for()
        output.locator("iframe[sandbox='allow-scripts']").first.wait_for()
        output.locator(".widget-html iframe[sandbox='allow-scripts']").wait_for()
        output.locator(".widget-output", has_text="output widget shown").wait_for()
        # Everyday output renders.
        output.locator("table.dataframe", has_text="Oslo").wait_for()
        output.locator(".widget-slider .widget-readout", has_text="4").wait_for()
        output.locator(".widget-html", has_text="5/5").first.wait_for()
        plot = output.locator("img[src^='data:image/png']")
        plot.wait_for()
        assert plot.evaluate("img => img.naturalWidth") > 100
        # The frames had their chance to run (their scripts run as they load), then nothing ran.
        page.wait_for_timeout(1000)
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "output-safety.png"), full_page=True)
        assert markers(page) == []
    assert sorted(path.name for path in jupyterlab.root.glob("pwned-*")) == []


def test_trusted_output_does_run_in_the_page(jupyterlab: Lab, kernelspec: str) -> None:
    try:
        with lab_page_that_ran(jupyterlab, kernelspec, TRUSTED_CELL) as page:
            page.locator(".jp-OutputArea-output").get_by_text("trusted cell ran").wait_for()
            page.wait_for_function("() => window.__pwned_trusted === 1")
            written = jupyterlab.root / "pwned-trusted.txt"
            deadline = time.monotonic() + 60
            while not written.exists() and time.monotonic() < deadline:  # the script's request is on its way
                time.sleep(0.1)
        assert written.read_text() == "pwned"  # the attack does work where output is trusted
    finally:
        (jupyterlab.root / "pwned-trusted.txt").unlink(missing_ok=True)
