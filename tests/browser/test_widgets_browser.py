"""ipywidgets in JupyterLab in a real browser, with the widgets' Python side in the sandbox.

JupyterLab and Chromium as in tests/browser/test_browser.py (tests/browser_helpers.py). The widget
models live in the sandbox; every change made in the page travels frontend → kernel →
sandbox as a comm message, and every change made in the sandbox comes back the same way.
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
