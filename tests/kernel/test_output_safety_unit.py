"""The output filter on its own: HTML, mime bundles and widget comm messages from the sandbox,
as the page would get them. What Chromium makes of the same strings, and JupyterLab of
a cell's output, is checked in tests/browser/test_output_safety_browser.py."""

from __future__ import annotations

import html
from random import Random
from typing import Any

import pandas as pd
import pytest

from output_attacks import ATTACKS, Tags, assert_inert, assert_isolated
from sandbox_kernel.kernel import output_safety
from sandbox_kernel.kernel import safe_html as safe_html_module
from sandbox_kernel.kernel.output_safety import OutputFilter, safe_markdown
from sandbox_kernel.kernel.safe_html import safe_html, sanitize


@pytest.mark.parametrize("attack", ATTACKS)
def test_attack_html_is_inert_inline_or_isolated_whole(attack: str) -> None:
    assert_inert(sanitize(attack).html)
    shown = safe_html(attack)
    if "<iframe" in shown:
        assert_isolated(shown, attack)
    else:
        assert_inert(shown)


@pytest.mark.parametrize("attack", [
    "<script>x()</script>", '<img src=x onerror="x()">', '<a href="javascript:x()">x</a>',
    "<svg><circle r=5 /></svg>", "<iframe src=https://example.org></iframe>", "<p ONCLICK=x()>",
])
def test_active_html_goes_to_the_frame(attack: str) -> None:
    assert sanitize(attack).active
    assert_isolated(safe_html(attack), attack)


def test_plain_html_stays_inline_with_text_escaped() -> None:
    shown = safe_html('<p class="note">1 &lt; 2 &amp; "quoted"</p><b>bold</b><unknown>kept text</unknown>')
    assert '<p class="note">1 &lt; 2 &amp; &quot;quoted&quot;</p><b>bold</b>kept text' in shown
    assert "<iframe" not in shown


def test_a_pandas_table_keeps_its_markup_and_its_style_scoped_to_the_output() -> None:
    frame = pd.DataFrame({"a": [1, 2], "b": ["x<y", "z"]})
    shown = sanitize(frame._repr_html_())
    assert not shown.active
    scope = Tags(shown.html).tags[0][1]["class"]
    assert scope.startswith("sk-output-")
    assert '<table border="1" class="dataframe">' in shown.html and "x&lt;y" in shown.html
    assert f"<style>.{scope} .dataframe tbody tr th:only-of-type {{vertical-align: middle;}}" in shown.html


def test_a_styler_keeps_its_cell_styles_with_ids_renamed_alike() -> None:
    styled = pd.DataFrame({"a": [1, 2]}).style.highlight_max(color="yellow").to_html()
    shown = sanitize(styled).html
    ids = [attrs["id"] for _, attrs in Tags(shown).tags if "id" in attrs]
    assert ids and all(element_id.startswith("user-content-T_") for element_id in ids)
    assert "#user-content-T_" in shown and "background-color: yellow" in shown


@pytest.mark.parametrize("css", [
    "body { display: none }", ".x { background: url(https://example.org/leak) }",
    "@import 'https://example.org/x.css'; .a {color: red}", ".a { color: re\\64 }",
    "> .jp-Dialog { display: none }", ".a { position: fixed; top: 0 }",
    ".a { color: red } </style><script>x()</script>", ".a { color: red",
])
def test_style_blocks_never_reach_outside_the_output_nor_load_anything(css: str) -> None:
    shown = sanitize(f"<style>{css}</style><p>x</p>").html
    scope = Tags(shown).tags[0][1].get("class")
    for block in shown.split("<style>")[1:]:
        rules = block.split("</style>")[0]
        for rule in filter(None, rules.splitlines()):
            assert all(selector.strip().startswith(f".{scope} ") for selector in rule.split("{")[0].split(","))
        assert "url" not in rules and "@" not in rules and "\\" not in rules and "fixed" not in rules


def test_remote_images_are_not_fetched_from_the_users_machine() -> None:
    shown = sanitize('<img src="https://example.org/leak?secret=1" alt="a"><img src="data:image/png;base64,AAAA">')
    assert "example.org" not in shown.html and 'src="data:image/png;base64,AAAA"' in shown.html


def test_math_that_would_make_a_link_is_not_typeset() -> None:
    assert "mathjax_ignore" in sanitize(r"<p>$\href{javascript:x()}{click}$</p>").html
    assert "mathjax_ignore" not in sanitize(r"<p>$x^2$</p>").html


@pytest.mark.parametrize("text, safe", [
    ("# Title\n\n*fine* and [a link](https://example.org) and $x^2$", True),
    ("<img src=x onerror=x()>", False),
    ("[x](javascript:x())", False),
    ("[x](java\\script:x())", False),
    ("[x](&#106;avascript:x())", False),
    ("[x]: javascript:x()\n\n[y][x]", False),
    ("![leak](https://example.org/?secret)", False),
    (r"$\href{javascript:x()}{x}$", False),
])
def test_markdown_is_kept_only_where_it_renders_inert(text: str, safe: bool) -> None:
    assert safe_markdown(text) is safe


# -- mime bundles ---------------------------------------------------------------------------

def test_javascript_is_withheld_with_one_line_that_says_so() -> None:
    data, metadata = OutputFilter().bundle(
        {"application/javascript": "x()", "text/plain": "<IPython.core.display.Javascript object>"},
        {"application/javascript": {}})
    assert list(data) == ["text/plain"] and metadata == {}
    assert data["text/plain"] == ("<IPython.core.display.Javascript object>\n[sandbox-kernel] application/javascript "
                                  "withheld: it could run code in this page, with your Jupyter rights "
                                  "(%sandbox trust-output on shows it)")


@pytest.mark.parametrize("mime", ["application/vnd.bokehjs_exec.v0+json", "application/vnd.holoviews_exec.v0+json",
                                  "application/x-custom", "text/javascript", "application/vnd.bokehjs_load.v0+json"])
def test_types_not_known_to_be_inert_are_withheld(mime: str) -> None:
    data, _ = OutputFilter().bundle({mime: "x()", "text/html": "<b>fallback</b>"}, {})
    assert mime not in data and "<b>fallback</b>" in data["text/html"]
    assert "text/plain" not in data  # a rich representation is left: no note


def test_everyday_bundles_pass_with_html_made_safe() -> None:
    bundle = {"text/plain": "fig", "image/png": "iVBOR", "image/svg+xml": "<svg onload='x()'/>",
              "application/json": {"a": 1}, "text/latex": "$x^2$", "text/markdown": "**b**",
              "application/pdf": "JVBER", "text/html": "<b>b</b>"}
    data, metadata = OutputFilter().bundle(bundle, {"image/png": {"width": 10}})
    assert {key: value for key, value in data.items() if key != "text/html"} == {
        key: value for key, value in bundle.items() if key != "text/html"}
    assert "<b>b</b>" in data["text/html"] and metadata == {"image/png": {"width": 10}}


def test_markdown_with_html_is_shown_as_its_text() -> None:
    data, _ = OutputFilter().bundle({"text/markdown": "<img src=x onerror=x()> hi", "text/plain": "<Markdown>"}, {})
    assert data == {"text/plain": "<img src=x onerror=x()> hi\n[sandbox-kernel] text/markdown withheld: it has raw "
                                  "HTML, entities, images or script links (%sandbox trust-output on shows it)"}


def test_trusted_output_passes_unchanged() -> None:
    output = OutputFilter()
    output.trusted = True
    bundle = {"application/javascript": "x()", "text/html": "<script>x()</script>"}
    assert output.bundle(bundle, {}) == (bundle, {})


def test_a_page_payload_and_user_expressions_are_filtered() -> None:
    output = OutputFilter()
    [page] = output.page_payload([{"source": "page", "data": {"text/html": "<script>x()</script>",
                                                               "text/plain": "doc"}, "start": 0}])
    assert "<iframe" in page["data"]["text/html"] and page["start"] == 0
    results = output.user_expressions({"a": {"status": "ok", "data": {"application/javascript": "x()"}, "metadata": {}}})
    assert "application/javascript" not in results["a"]["data"]


# -- widget comms -----------------------------------------------------------------------------

def widget_open(comm_id: str, view: str, module: str = "@jupyter-widgets/controls", **state: Any) -> dict[str, Any]:
    return {"comm_id": comm_id, "target_name": "jupyter.widget",
            "data": {"state": {"_model_module": module, "_view_module": module, "_model_name": view.replace("View", "Model"),
                               "_view_name": view, **state}, "buffer_paths": []}}


def update(comm_id: str, buffer_paths: list[list[str]] | None = None, **state: Any) -> dict[str, Any]:
    return {"comm_id": comm_id, "data": {"method": "update", "state": state, "buffer_paths": buffer_paths or []}}


def test_an_html_widget_value_is_made_safe_when_opened_and_updated() -> None:
    output = OutputFilter()
    opened, _ = output.comm_from_sandbox("comm_open", widget_open("h", "HTMLView", value="<img src=x onerror=x()>"), [])
    assert_isolated(opened["data"]["state"]["value"], "<img src=x onerror=x()>")
    updated, _ = output.comm_from_sandbox("comm_msg", update("h", value="<b onclick=x()>b</b>"), [])
    assert "onclick" not in html.unescape(updated["data"]["state"]["value"].split("srcdoc")[0])


def test_a_text_widget_value_is_left_alone_and_cannot_become_html() -> None:
    output = OutputFilter()
    output.comm_from_sandbox("comm_open", widget_open("t", "TextView", value="a < b"), [])
    updated, _ = output.comm_from_sandbox("comm_msg", update("t", _view_name="HTMLView", value="<script>x()</script>"), [])
    assert updated["data"]["state"] == {"value": "<script>x()</script>"}  # an input's text: inert


def test_an_html_description_is_made_safe_even_when_html_is_allowed_later() -> None:
    output = OutputFilter()
    output.comm_from_sandbox("comm_open", widget_open("s", "IntSliderView", description="<img src=x onerror=x()>"), [])
    updated, _ = output.comm_from_sandbox("comm_msg", update("s", description_allow_html=True), [])
    assert "onerror" not in updated["data"]["state"]["description"].split("srcdoc")[0]


def test_an_output_widget_cannot_carry_javascript() -> None:
    output = OutputFilter()
    output.comm_from_sandbox("comm_open", widget_open("o", "OutputView", module="@jupyter-widgets/output"), [])
    js = {"output_type": "display_data", "data": {"application/javascript": "x()", "text/plain": "js"}, "metadata": {}}
    updated, _ = output.comm_from_sandbox("comm_msg", update("o", outputs=[js, {"output_type": "stream", "text": "hi"}]), [])
    outputs = updated["data"]["state"]["outputs"]
    assert "application/javascript" not in outputs[0]["data"] and outputs[1] == {"output_type": "stream", "text": "hi"}


def test_a_widget_of_another_library_is_withheld_with_its_messages_and_views() -> None:
    output = OutputFilter()
    anywidget = widget_open("w", "AnyView", module="anywidget", _esm="fetch('/api/contents')")
    assert output.comm_from_sandbox("comm_open", anywidget, []) is None
    assert output.comm_from_sandbox("comm_msg", update("w", _esm="x()"), []) is None
    data, _ = output.bundle({"application/vnd.jupyter.widget-view+json": {"model_id": "w"}, "text/plain": "AnyWidget()"}, {})
    assert data["text/plain"].startswith("AnyWidget()\n[sandbox-kernel] application/vnd.jupyter.widget-view+json withheld")


def test_comms_to_other_targets_pass_and_comms_never_opened_do_not() -> None:
    output = OutputFilter()
    opened = {"comm_id": "c", "target_name": "an-extensions-target", "data": {"x": 1}}
    assert output.comm_from_sandbox("comm_open", opened, []) == (opened, [])
    assert output.comm_from_sandbox("comm_msg", {"comm_id": "c", "data": {"x": 2}}, []) is not None
    assert output.comm_from_sandbox("comm_msg", {"comm_id": "never-opened", "data": {}}, []) is None


def test_the_state_reply_a_reloaded_page_asks_for_is_filtered_buffers_and_all() -> None:
    output = OutputFilter()
    output.comm_from_frontend("comm_open", {"comm_id": "control", "target_name": "jupyter.widget.control"})
    states = {
        "h": {"model_module": "@jupyter-widgets/controls",
              "state": widget_open("h", "HTMLView", value="<script>x()</script>")["data"]["state"]},
        "img": {"model_module": "@jupyter-widgets/controls",
                "state": widget_open("img", "ImageView", format="png")["data"]["state"]},
        "any": {"model_module": "anywidget", "state": widget_open("any", "AnyView", module="anywidget")["data"]["state"]},
    }
    message = {"comm_id": "control", "data": {"method": "update_states", "states": states,
                                              "buffer_paths": [["any", "state", "x"], ["img", "state", "value"]]}}
    filtered, buffers = output.comm_from_sandbox("comm_msg", message, [b"any", b"png"])
    assert set(filtered["data"]["states"]) == {"h", "img"}
    assert "<iframe" in filtered["data"]["states"]["h"]["state"]["value"]
    assert filtered["data"]["buffer_paths"] == [["img", "state", "value"]] and buffers == [b"png"]
    assert output.comm_from_sandbox("comm_msg", update("any", x=1), []) is None  # learned from the reply


def test_trusted_comms_pass_unchanged() -> None:
    output = OutputFilter()
    output.trusted = True
    anywidget = widget_open("w", "AnyView", module="anywidget", _esm="x()")
    assert output.comm_from_sandbox("comm_open", anywidget, [b"1"]) == (anywidget, [b"1"])


def test_the_comms_remembered_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(output_safety, "MAX_COMMS", 3)
    output = OutputFilter()
    for i in range(3):
        assert output.comm_from_sandbox("comm_open", widget_open(f"s{i}", "IntSliderView"), []) is not None
    assert output.comm_from_sandbox("comm_open", widget_open("past", "IntSliderView"), []) is None
    assert output.comm_from_sandbox("comm_open", widget_open("other", "AnyView", module="anywidget"), []) is None
    assert len(output.widgets) + len(output.withheld) + len(output.other_comms) == 3
    output.comm_from_sandbox("comm_close", {"comm_id": "s0", "data": {}}, [])
    assert output.comm_from_sandbox("comm_open", widget_open("again", "IntSliderView"), []) is not None


# -- the simple shape's shortcut reads HTML exactly as the parser does -------------------------

FRAGMENTS = [
    "<td>", "</td>", "<tr>", "</tr>", "<th>", "</th>", "<b>", "</b>", "<i>", "</i>", "<div>", "</div>",
    '<td class="x">', '<p align="left" style="color: red">', '<span id="a">', '<a href="https://e.org">',
    '<a href="javascript:x()">', "</a>", '<img src="data:image/png;base64,AA">', "<br>", "<br/>",
    "<unknown>", "</unknown>", "<style scoped>.a { color: red }</style>", "<style>.a{background:url(x)}</style>",
    "<style>", "</style>", "<script>x()</script>", "<svg>", "<TD>", "<td onclick=\"x()\">", "<td title='q'>",
    '<td title="a&amp;b">', "<!-- c -->", "<!doctype html>", "text", " 1 &lt; 2 ", "a > b", "it's", '"q"',
    "\\href{x}", "\n  ", "<td\nclass=\"x\">", "</td >", "<p title=\"<b>\">", "<table border=\"1\">", "</table>",
]


def simple_and_parsed(source: str) -> tuple[safe_html_module.Sanitized | None, safe_html_module.Sanitized]:
    fast = safe_html_module._sanitize_simple(source, safe_html_module._Sanitizer("scope"))
    parser = safe_html_module._Sanitizer("scope")
    parser.feed(source)
    parser.close()
    return fast, parser.result()


def test_the_shortcut_gives_the_parsers_html_or_leaves_it_to_the_parser() -> None:
    random = Random(20261206)
    taken = 0
    for _ in range(3000):
        source = "".join(random.choice(FRAGMENTS) for _ in range(random.randint(1, 12)))
        fast, parsed = simple_and_parsed(source)
        if fast is not None:
            taken += 1
            assert fast == parsed, source
    for attack in ATTACKS:
        fast, parsed = simple_and_parsed(attack)
        assert fast is None or (fast == parsed and not parsed.active), attack
    assert taken > 300  # the shortcut is taken for a good part of the mixes, not never


def test_a_large_dataframe_takes_the_shortcut_and_reads_the_same() -> None:
    frame = pd.DataFrame({"n": range(300), "word": ["w"] * 300}).to_html() + pd.DataFrame([[1]])._repr_html_()
    fast, parsed = simple_and_parsed(frame)
    assert fast is not None and fast == parsed
