"""ipywidgets in JupyterLab in a real browser, with the widgets' Python side in the sandbox.

JupyterLab and Chromium as in tests/browser/test_browser.py (tests/browser_helpers.py). The widget
models live in the sandbox; every change made in the page travels frontend → kernel →
sandbox as a comm message, and every change made in the sandbox comes back the same way. The
kernel's own widget, %sandbox sweep's progress bar, is checked here too.
Screenshots are kept in test-artifacts/.
"""

from __future__ import annotations

import pytest

from browser_helpers import SLIDER_CELL, Lab, lab_page_that_ran, press_on_slider, screenshot

pytestmark = [pytest.mark.slow, pytest.mark.browser]

BACKGROUND_CELL = """\
import threading, time
import ipywidgets as widgets
progress = widgets.IntProgress(value=0, max=5, description='thread')
label = widgets.Label('thread: started')
display(progress, label)

def work():
    for step in range(1, 6):
        time.sleep(0.2)
        progress.value = step
    label.value = f'thread: done at {progress.value}'

threading.Thread(target=work).start()"""

TQDM_CELL = """\
import time
from tqdm.auto import tqdm
for _ in tqdm(range(20), desc='sandbox work'):
    time.sleep(0.02)"""

INTERACT_CELL = """\
from ipywidgets import interact

@interact(x=(0, 10))
def square(x=4):
    print('square is', x * x)"""


# Seconds per branch, one branch at a time: the bar is on the page for a while.
SWEEP_CELL = "%sandbox sweep -p pause 1 2 3 --jobs 1 -- import time; time.sleep(pause); pause * 10"

# The kernel's bar leaves the page when the sweep ends (its display becomes the outcome's line,
# its views go with its models): what its bar and label showed then is read from their nodes
# as they were removed.
WATCH_REMOVED_WIDGETS = """() => {
    window.removed = {widths: [], labels: []};
    const within = (node, selector) => node.matches(selector) ? node : node.querySelector(selector);
    new MutationObserver(records => {
        for (const node of records.flatMap(record => [...record.removedNodes])) {
            if (node.nodeType !== 1) continue;
            const bar = within(node, '.progress-bar'), label = within(node, '.widget-label');
            if (bar) window.removed.widths.push(bar.style.width);
            if (label) window.removed.labels.push(label.textContent);
        }
    }).observe(document.body, {childList: true, subtree: true});
}"""


def test_a_slider_moved_in_the_page_reaches_its_observer_in_the_sandbox(jupyterlab: Lab, kernelspec: str) -> None:
    with lab_page_that_ran(jupyterlab, kernelspec, SLIDER_CELL) as page:
        output = page.locator(".jp-OutputArea-output")
        output.locator(".widget-slider .widget-readout", has_text="3").wait_for()
        # A quick burst: the page sends the next change only once the kernel says the previous
        # one is idle (values in between may be skipped, as under ipykernel; the last never is).
        press_on_slider(page, "ArrowRight", 4)
        output.locator(".widget-slider .widget-readout", has_text="7").wait_for()
        try:  # the observer's print, captured by the Output widget, shown in the cell
            output.locator(".widget-output", has_text="the sandbox saw 7").wait_for()
        finally:
            screenshot(page, "widgets-slider.png")


def test_a_widget_updated_by_a_background_thread_moves_in_the_page(jupyterlab: Lab, kernelspec: str) -> None:
    with lab_page_that_ran(jupyterlab, kernelspec, BACKGROUND_CELL) as page:
        output = page.locator(".jp-OutputArea-output")
        output.get_by_text("thread: done at 5").wait_for()
        bar = output.locator(".widget-hprogress .progress-bar")
        screenshot(page, "widgets-background-thread.png")
        # The bar is full: its width is the whole track's.
        assert bar.evaluate("bar => bar.style.width") == "100%"


def test_tqdm_auto_shows_a_widget_progress_bar_that_completes(jupyterlab: Lab, kernelspec: str) -> None:
    with lab_page_that_ran(jupyterlab, kernelspec, TQDM_CELL) as page:
        output = page.locator(".jp-OutputArea-output")
        output.locator(".widget-html", has_text="20/20").first.wait_for()
        bar = output.locator(".widget-hprogress .progress-bar")
        bar.wait_for()
        screenshot(page, "widgets-tqdm.png")
        assert bar.evaluate("bar => bar.style.width") == "100%"
        assert output.locator(".jp-RenderedText", has_text="it/s").count() == 0  # no text bar


def test_interact_reruns_the_function_in_the_sandbox(jupyterlab: Lab, kernelspec: str) -> None:
    with lab_page_that_ran(jupyterlab, kernelspec, INTERACT_CELL) as page:
        output = page.locator(".jp-OutputArea-output")
        output.get_by_text("square is 16").wait_for()
        press_on_slider(page, "ArrowRight", 3)  # a burst, as in the slider test
        output.get_by_text("square is 49").wait_for()
        screenshot(page, "widgets-interact.png")
        assert output.get_by_text("square is 16").count() == 0  # interact cleared the earlier output


def test_a_sweep_shows_its_progress_as_a_widget_bar_then_its_table(jupyterlab: Lab, kernelspec: str) -> None:
    """The kernel's own bar (kernel/progress_widget.py), not the sandbox's: the page's widget
    manager renders it from the kernel's comm messages."""
    with lab_page_that_ran(jupyterlab, kernelspec, SWEEP_CELL, run=False) as page:
        page.evaluate(WATCH_REMOVED_WIDGETS)
        page.keyboard.press("Shift+Enter")
        output = page.locator(".jp-OutputArea-output")
        output.locator(".widget-hprogress .progress-bar").wait_for()
        screenshot(page, "widgets-sweep-running.png")
        output.locator("table", has_text="pause=3").wait_for()
        screenshot(page, "widgets-sweep-done.png")
        assert output.get_by_text("Swept 3 branch(es) over forks of sb-").count() == 1
        assert output.locator(".widget-hprogress").count() == 0  # the bar is gone, its line in its place
        rows = output.locator("table tr").all_inner_texts()
        assert [row.split() for row in rows[1:]] == [[f"pause={pause}", "ok", str(pause * 10)] for pause in (1, 2, 3)]
        # When it went, the bar was full and its label said so.
        removed = page.evaluate("window.removed")
        assert "100%" in removed["widths"], removed
        assert any(label.endswith(": 3 of 3 done") for label in removed["labels"]), removed
