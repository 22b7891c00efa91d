"""Output that would run code in the notebook's page, from a real cell in a real sandbox.

The cell displays what JupyterLab would run in the page (a Javascript object, HTML with a
script or a handler, an HTML widget, an Output widget carrying Javascript, a widget of a
library whose frontend runs the model's code) and prints that it did all of it; what reaches
IOPub, the page's only source, must carry nothing that runs there. `%sandbox trust-output on`
lets it through unchanged (which shows the test sees the attack when it is there).
In JupyterLab itself: tests/browser/test_output_safety_browser.py.
"""

from __future__ import annotations

import html
from typing import Any

import pytest
from jupyter_client.blocking.client import BlockingKernelClient

from kernel_helpers import execute
from output_attacks import Tags, assert_inert
from sandbox_kernel.kernel.output_safety import SAFE_MIME_TYPES
from sandbox_kernel.kernel.safe_html import FRAME_POLICY

pytestmark = [pytest.mark.slow, pytest.mark.one_path]

ATTACK_CELL = """\
import ipywidgets as widgets
from traitlets import Unicode
from IPython.display import HTML, Javascript, Markdown, display

class Evil(widgets.DOMWidget):  # as anywidget: its frontend runs the model's code
    _model_module = Unicode('evil-widgets').tag(sync=True)
    _view_module = Unicode('evil-widgets').tag(sync=True)
    _esm = Unicode("export function render() { window.__pwned = 1 }").tag(sync=True)

display(Javascript('window.__pwned = 1'))
display(HTML('<b>bold</b><script>window.__pwned = 1</script>'))
display(HTML('<img src=x onerror="window.__pwned = 1">'))
display(Markdown('<img src=x onerror="window.__pwned = 1">'))
html = widgets.HTML(value='<img src=x onerror="window.__pwned = 1">')
out = widgets.Output()
out.outputs = ({'output_type': 'display_data', 'metadata': {},
                'data': {'application/javascript': 'window.__pwned = 1', 'text/plain': 'js'}},)
with out:
    display(Javascript('window.__pwned = 1'))
display(html, out, Evil())
html.value = '<svg onload="window.__pwned = 1">'
print('all attacks displayed')
"""


def shown_code(messages: list[dict[str, Any]]) -> list[str]:
    """What in these IOPub messages would run in the page (empty: nothing)."""
    found: list[str] = []
    for msg in messages:
        content = msg["content"]
        if msg["msg_type"] in ("display_data", "update_display_data", "execute_result"):
            found += bundle_code(content["data"])
        elif msg["msg_type"] in ("comm_open", "comm_msg"):
            state = content["data"].get("state", {})
            if msg["msg_type"] == "comm_open" and state.get("_model_module") == "evil-widgets":
                found.append("a model of a widget library that runs its code")
            if isinstance(state.get("value"), str) and state.get("_view_name", "HTMLView") == "HTMLView":
                found += html_code(state["value"])
            for output in state.get("outputs", []):
                found += bundle_code(output.get("data", {}))
    return found


def bundle_code(data: dict[str, Any]) -> list[str]:
    found = [mime for mime in data if mime not in SAFE_MIME_TYPES]
    if "onerror" in data.get("text/markdown", ""):
        found.append("markdown with HTML")
    return found + html_code(data.get("text/html", ""))


def html_code(markup: str) -> list[str]:
    """The HTML as it came, unless it is inert inline HTML or one offline sandboxed frame."""
    try:
        assert_inert(markup)
        return []
    except AssertionError:
        tags = Tags(markup).tags
    if [tag for tag, _ in tags] == ["div", "iframe"] and tags[1][1].get("sandbox") == "allow-scripts" and \
            (tags[1][1].get("srcdoc") or "").startswith(f'<meta http-equiv="Content-Security-Policy" content="{FRAME_POLICY}">'):
        return []
    return [markup]


def test_output_that_would_run_in_the_page_is_withheld_or_isolated(kc: BlockingKernelClient) -> None:
    run = execute(kc, ATTACK_CELL)
    assert run.reply["content"]["status"] == "ok", run.text("stderr")
    assert "all attacks displayed" in run.text()  # the attack ran in the sandbox
    assert shown_code(run.messages) == []
    texts = [m["content"]["data"].get("text/plain", "") for m in run.messages if m["msg_type"] == "display_data"]
    assert any("application/javascript withheld" in text for text in texts)  # said, not silently lost
    # The HTML with a script is shown whole, in its frame.
    assert any("<b>bold</b>" in html.unescape(m["content"]["data"].get("text/html", "")) for m in run.messages
               if m["msg_type"] == "display_data")


def test_trusted_output_reaches_the_page_unchanged(kc: BlockingKernelClient) -> None:
    trusting = execute(kc, "%sandbox trust-output on")
    assert "Warning: the sandbox's output now runs in this page" in trusting.text("stderr")
    try:
        run = execute(kc, ATTACK_CELL)
        assert run.reply["content"]["status"] == "ok", run.text("stderr")
        found = shown_code(run.messages)
        assert "application/javascript" in found and "a model of a widget library that runs its code" in found
        assert any("<script>window.__pwned = 1</script>" in item for item in found)
        status = execute(kc, "%sandbox status")
        assert "trusted: shown unchanged" in status.of_type("display_data")[0]["data"]["text/plain"]
    finally:
        assert "filtered again" in execute(kc, "%sandbox trust-output off").text()
    assert shown_code(execute(kc, ATTACK_CELL).messages) == []
