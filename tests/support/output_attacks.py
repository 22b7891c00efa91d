"""HTML that tries to run code in the notebook's page, for the output filter's tests.

Each payload sets `top.__pwned` when its code runs: in the page that is the page's own window;
from a sandboxed frame (an opaque origin) the write throws, so the page stays clean.
FIRES_UNAIDED are the payloads that run as soon as JupyterLab puts them into the page (innerHTML,
then its scripts re-created), with no click (the others are in NOT_UNAIDED): tests/browser/test_output_safety_browser.py proves that on
the unfiltered payloads before it shows that none runs after the filter.
"""

from __future__ import annotations

from html.parser import HTMLParser

from sandbox_kernel.kernel.safe_html import ALLOWED_TAGS, FRAME_POLICY

SET = "top.__pwned=1"

FIRES_UNAIDED = [
    f"<script>{SET}</script>",
    f"<SCRIPT>{SET}</SCRIPT>",
    f"<div>\n<sCrIpT\n>{SET}</script\n>",
    f'<img src=x onerror="{SET}">',
    f"<IMG SRC=x OnErRoR={SET}>",
    "<img src=x onerror=&#116;op.__pwned=1>",  # an entity in the handler
    f'<img/src="x"/onerror={SET}>',
    f"<svg><script>{SET}</script></svg>",
    f'<iframe src="javascript:{SET}"></iframe>',
    f'<iframe srcdoc="<script>{SET}</script>"></iframe>',
    f"<details open ontoggle={SET}>x</details>",
    f"<style></style><script>{SET}</script>",
    f"<style>a{{}}</style x><img src=x onerror={SET}></style>",  # html.parser ends a style only at </style>
    f'<noscript><p title="</noscript><img src=x onerror={SET}>"></noscript>',
    f'<textarea><img title="</textarea><img src=x onerror={SET}>"></textarea>',
    f'<xmp><img title="</xmp><img src=x onerror={SET}>"></xmp>',
    f"<svg><style><img src=x onerror={SET}></style></svg>",
    f'<!--<img src="--><img src=x onerror={SET}//">',
    f'<img src="x" <img src=x onerror={SET}>',
    f"<video><source onerror={SET}></video>",
    f"<input autofocus onfocus={SET}>",
]
# Refused all the same: they run on a click, in older browsers, or where a sanitizer's parser
# and the browser's disagree.
NOT_UNAIDED = [
    f"<svg onload={SET}></svg>",
    f"<math><mtext><table><mglyph><style><img src=x onerror={SET}>",  # mutation XSS (DOMPurify 2.0.0)
    f"<scr<script>ipt>{SET}</script>",
    f'<object data="javascript:{SET}"></object>',
    f'<a href="javascript:{SET}">x</a>',
    f'<a href="&#106;avascript:{SET}">x</a>',
    f'<a href=" java\tscript:{SET}">x</a>',
    f'<a href="#" onclick="{SET}">x</a>',
    f'<p title="a&quot; onmouseover={SET}">x</p>',
    f'<form><button formaction="javascript:{SET}">x</button></form>',
    '<base href="javascript:/"><a href="x">x</a>',
    f'<meta http-equiv="refresh" content="0;url=javascript:{SET}">',
    f"<div style=\"background:url(javascript:{SET})\">x</div>",
    f'<div style="width: expression({SET})">x</div>',
    f"<![CDATA[<img src=x onerror={SET}>]]>",
    f"<template><img src=x onerror={SET}></template>",
    f"<img src=x onerror={SET}//",  # never closed
]
ATTACKS = FIRES_UNAIDED + NOT_UNAIDED


class Tags(HTMLParser):
    """Every start tag of a document, with its attributes."""

    def __init__(self, source: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.feed(source)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))

    handle_startendtag = handle_starttag


def assert_inert(markup: str) -> None:
    """Only allowlisted tags, no handler, and URLs that are links or embedded images."""
    for tag, attrs in Tags(markup).tags:
        assert tag in ALLOWED_TAGS or tag == "style", markup
        for name, value in attrs.items():
            assert not name.startswith("on"), markup
            if name == "href":
                assert (value or "").startswith(("http:", "https:", "mailto:", "#")), markup
            if name == "src":
                assert (value or "").startswith("data:image/"), markup
            if name == "style":
                assert "url" not in (value or "") and "expression" not in (value or ""), markup


def assert_isolated(markup: str, source: str) -> None:
    """The whole source in a frame with scripts but without the page's origin, and offline."""
    tags = Tags(markup).tags
    assert [tag for tag, _ in tags] == ["div", "iframe"], markup
    frame = tags[1][1]
    assert frame["sandbox"] == "allow-scripts"  # no allow-same-origin, forms, popups or top navigation
    assert frame["srcdoc"] == f'<meta http-equiv="Content-Security-Policy" content="{FRAME_POLICY}">{source}'
