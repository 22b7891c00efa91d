"""HTML from the sandbox, made safe to put into the notebook's page.

JupyterLab puts a fresh output's text/html into the page with innerHTML and runs its <script>
tags: code there runs with the page's origin, so it could call the Jupyter server's REST API
(files, terminals) with the user's rights. Two treatments, chosen per document:

- Plain HTML (tables, formatted text, images) is re-serialised through an allowlist: text
  escaped, attributes quoted, unknown tags and attributes dropped, URLs limited to links the
  user clicks and images embedded as data, CSS kept only where it can neither load anything
  nor reach outside its output (<style> rules are scoped to the output's own wrapper). What we
  emit is parsed by the browser exactly as we meant it: only tags without a parsing mode of
  their own (no svg, math, template, noscript, textarea) and no raw markup in text.
- Active HTML (scripts, event handlers, javascript: URLs, svg/math, frames and plugins: what
  the allowlist would have to cut) is shown whole in an <iframe sandbox="allow-scripts">
  without allow-same-origin: its scripts run (a plotly chart drawn by its inlined plotly.js
  works), in an opaque origin that cannot touch the page, its cookies or the server. A
  Content-Security-Policy inside the frame keeps it off the network: the browser runs on the
  user's machine, outside the sandbox's egress rules.
"""

from __future__ import annotations

import html
import re
import uuid
from dataclasses import dataclass
from html.parser import HTMLParser

# Tags kept inline, with their attributes (plus GLOBAL_ATTRIBUTES on every one).
ALLOWED_TAGS: dict[str, frozenset[str]] = {tag: frozenset(attributes) for tag, attributes in {
    "a": ("href",), "abbr": (), "b": (), "bdi": (), "bdo": (), "blockquote": (), "br": (), "caption": (),
    "center": (), "cite": (), "code": (), "col": ("span",), "colgroup": ("span",), "dd": (), "del": (),
    "details": ("open",), "dfn": (), "div": (), "dl": (), "dt": (), "em": (), "figcaption": (),
    "figure": (), "font": ("color", "face", "size"), "h1": (), "h2": (), "h3": (), "h4": (), "h5": (),
    "h6": (), "hr": (), "i": (), "img": ("src", "alt"), "ins": (), "kbd": (), "label": (), "li": ("value",),
    "mark": (), "meter": ("value", "min", "max", "low", "high", "optimum"), "ol": ("start", "reversed", "type"),
    "p": (), "pre": (), "progress": ("value", "max"), "q": (), "rp": (), "rt": (), "ruby": (), "s": (),
    "samp": (), "small": (), "span": (), "strong": (), "sub": (), "summary": (), "sup": (),
    "table": ("border", "cellpadding", "cellspacing"), "tbody": (), "td": ("colspan", "rowspan", "headers"),
    "tfoot": (), "th": ("colspan", "rowspan", "headers", "scope"), "thead": (), "time": ("datetime",),
    "tr": (), "tt": (), "u": (), "ul": (), "var": (), "wbr": (),
}.items()}
GLOBAL_ATTRIBUTES = frozenset({"class", "id", "title", "style", "align", "valign", "width", "height",
                               "dir", "lang", "bgcolor"})
VOID_TAGS = frozenset({"br", "col", "hr", "img", "wbr"})
# Dropped with everything inside them: their content is code, metadata, or markup that the
# browser parses in a mode of its own (the root of mutation-XSS tricks).
DROPPED_WITH_CONTENT = frozenset({"script", "style", "template", "noscript", "textarea", "title", "xmp",
                                  "noembed", "noframes", "plaintext", "select", "head", "iframe", "object",
                                  "embed", "applet", "svg", "math", "frameset", "frame", "portal"})
# Content that needs to run or to be parsed as its own document: shown in a sandboxed frame.
ACTIVE_TAGS = frozenset({"script", "iframe", "object", "embed", "applet", "svg", "math", "frame",
                         "frameset", "portal"})
URL_ATTRIBUTES = frozenset({"href", "src", "action", "formaction", "data", "poster", "background",
                            "xlink:href", "codebase", "cite", "lowsrc", "dynsrc", "ping"})
SCRIPT_URL = re.compile(r"^(javascript|vbscript|livescript):", re.I)
LINK_SCHEMES = ("http:", "https:", "mailto:")
IMAGE_DATA_URL = re.compile(r"^data:image/(png|jpeg|gif|webp|bmp|svg\+xml)[;,]", re.I)
# Browsers ignore these characters in URLs (tab, newline) or at their ends (controls, space).
URL_IGNORED = re.compile(r"[\x00-\x20\x7f]")
# CSS that could load something (url(), image-set(), @import), run something (expression,
# behaviors, bindings), be written so that these checks miss it (escapes, comments, at-rules)
# or cover the page's own controls (fixed or sticky positioning).
CSS_FORBIDDEN = re.compile(r"url\s*\(|image|expression|@|\\|<|javascript|behavior|binding|"
                           r"position\s*:\s*(fixed|sticky)", re.I)
CSS_COMMENT = re.compile(r"/\*.*?(\*/|$)", re.S)
CSS_RULE = re.compile(r"\s*([^{}@]+)\{([^{}]*)\}\s*")
# TeX that a notebook's typesetter (MathJax) would turn into a link, a style or a download:
# HTML text and markdown with it are not typeset, or not rendered as markdown.
RISKY_TEX = re.compile(r"\\(href|url|style|class|cssid|require|unicode|html\w*|data)\b", re.I)
MATH_OFF = "tex2jax_ignore mathjax_ignore"  # JupyterLab's typesetter skips these classes
ID_PREFIX = "user-content-"  # ids of the output's elements never name the page's globals
FRAME_HEIGHT = 400  # px; the frame's content cannot tell the page its height
# The frame's document: scripts and styles inline only, nothing fetched, no form sent.
FRAME_POLICY = ("default-src 'none'; script-src 'unsafe-inline' 'unsafe-eval' data: blob:; "
                "style-src 'unsafe-inline' data: blob:; img-src data: blob:; font-src data: blob:; "
                "media-src data: blob:; frame-src data: blob:; worker-src blob:; form-action 'none'; "
                "base-uri 'none'")


def safe_html(source: str) -> str:
    """`source` as HTML that cannot run in, load into, or restyle the page."""
    sanitized = sanitize(source)
    return sandboxed_frame(source) if sanitized.active else sanitized.html


def sanitize(source: str) -> Sanitized:
    """`source` through the allowlist (in a <div> its <style> rules are scoped to, if it has any)."""
    parser = _Sanitizer(scope=f"sk-output-{uuid.uuid4().hex[:16]}")
    simple = _sanitize_simple(source, parser)
    if simple is not None:
        return simple
    parser.feed(source)
    parser.close()
    return parser.result()


# The shape of a table, a DataFrame's repr or formatted text: tags from the allowlist with
# lowercase names and double-quoted plain values, top-level style blocks, and text without
# markup characters. Most HTML outputs have it, and megabytes of it (a DataFrame of 50,000
# rows is 10 MB): parsed tag by tag in Python that costs about a second per megabyte.
SIMPLE_TOKEN = re.compile(r"<style(?:[ \t\n]+scoped)?>(?P<css>[^<]*)</style>|<[^<>]*>")
SIMPLE_START = re.compile(r'<([a-z][a-z0-9]*)((?:[ \t\n]+[a-z][a-z0-9-]*(?:="[^"<>&]*")?)*)[ \t\n]*>')
SIMPLE_ATTRIBUTE = re.compile(r'[ \t\n]+([a-z][a-z0-9-]*)(?:="([^"<>&]*)")?')
SIMPLE_END = re.compile(r"</([a-z][a-z0-9]*)[ \t\n]*>")
MARKUP_IN_TEXT = re.compile(r"[<>&\"']")


def _sanitize_simple(source: str, parser: _Sanitizer) -> Sanitized | None:
    """What parser would make of `source`, computed once per distinct tag rather than once per
    tag, or None when `source` is not of the simple shape (the parser then reads it).

    Only where the parser's reading is certain is it skipped: every tag matches the strict
    forms above, no tag is one the parser drops with its content or that makes the output
    active, and the text between tags has nothing the parser would decode or escape.
    tests/kernel/test_output_safety_unit.py checks that both give the same HTML."""
    text = SIMPLE_TOKEN.sub("", source)
    if MARKUP_IN_TEXT.search(text) or risky_tex(text):
        return None
    open_tags: list[str] = []
    tags: dict[str, tuple[str, str | None] | None] = {}  # token -> (name, start tag output or None)

    class NotSimple(Exception):
        pass

    def rewrite(match: re.Match[str]) -> str:
        token, css = match.group(0, "css")
        if css is not None:
            scoped = scoped_css(css, parser.scope)
            if not scoped:
                return ""
            parser.styled = True
            return f"<style>{scoped}</style>"
        if token not in tags:
            tags[token] = _simple_tag(token, parser)
        tag = tags[token]
        if tag is None:
            raise NotSimple
        name, start = tag
        if start is not None:
            if start and name not in VOID_TAGS:
                open_tags.append(name)
            return start
        if open_tags and open_tags[-1] == name:
            open_tags.pop()
            return f"</{name}>"
        if name not in open_tags:
            return ""
        closed = []
        while open_tags:
            inner = open_tags.pop()
            closed.append(f"</{inner}>")
            if inner == name:
                break
        return "".join(closed)

    try:
        body = SIMPLE_TOKEN.sub(rewrite, source)
    except NotSimple:
        parser.styled = False
        return None
    body += "".join(f"</{tag}>" for tag in reversed(open_tags))
    return Sanitized(f'<div class="{parser.scope}">{body}</div>' if parser.styled else body, False)


def _simple_tag(token: str, parser: _Sanitizer) -> tuple[str, str | None] | None:
    """(name, what the parser emits for this start tag) or (name, None) for an end tag; None if
    the token is not of the simple shape or not plainly safe."""
    end = SIMPLE_END.fullmatch(token)
    if end is not None:
        name = end.group(1)
        return None if name in DROPPED_WITH_CONTENT else (name, None)
    start = SIMPLE_START.fullmatch(token)
    if start is None:
        return None
    name = start.group(1)
    attrs = [(attribute.group(1), attribute.group(2)) for attribute in SIMPLE_ATTRIBUTE.finditer(start.group(2))]
    probe = _Sanitizer(parser.scope)
    probe._note_active(name, attrs)
    if probe.active or name in DROPPED_WITH_CONTENT:
        return None
    if name not in ALLOWED_TAGS:
        return (name, "")  # the tag goes, its content stays
    kept = "".join(f' {attribute}="{html.escape(value, quote=True)}"'
                   for attribute, value in probe._kept_attributes(name, attrs))
    return (name, f"<{name}{kept}>")


def sandboxed_frame(source: str) -> str:
    """`source` as the whole document of a sandboxed frame (scripts yes, page and network no)."""
    document = f'<meta http-equiv="Content-Security-Policy" content="{FRAME_POLICY}">{source}'
    return (f'<div style="resize: vertical; overflow: hidden; height: {FRAME_HEIGHT}px">'
            f'<iframe sandbox="allow-scripts" referrerpolicy="no-referrer" '
            f'title="output run apart from this page (sandbox-kernel)" '
            f'style="width: 100%; height: 100%; border: 0" srcdoc="{html.escape(document, quote=True)}">'
            f"</iframe></div>")


def risky_tex(text: str) -> bool:
    return RISKY_TEX.search(text) is not None


@dataclass
class Sanitized:
    html: str
    active: bool  # it had content the allowlist cut that the sandboxed frame can show


class _Sanitizer(HTMLParser):
    def __init__(self, scope: str) -> None:
        super().__init__(convert_charrefs=True)  # text and attribute values arrive decoded
        self.scope = scope
        self.out: list[str] = []
        self.open_tags: list[str] = []
        self.skipping: list[str] = []  # the DROPPED_WITH_CONTENT tags we are inside
        self.style_text: list[str] = []  # a top-level <style> block's text, until its end tag
        self.active = False
        self.risky_math = False
        self.styled = False  # a <style> block was kept: the output needs its scope's wrapper

    def result(self) -> Sanitized:
        body = "".join(self.out) + "".join(f"</{tag}>" for tag in reversed(self.open_tags))
        if not self.styled and not self.risky_math:
            return Sanitized(body, self.active)
        classes = (self.scope if self.styled else "") + (f" {MATH_OFF}" if self.risky_math else "")
        return Sanitized(f'<div class="{classes.strip()}">{body}</div>', self.active)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._start(tag, attrs, closed=False)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._start(tag, attrs, closed=True)

    def _start(self, tag: str, attrs: list[tuple[str, str | None]], closed: bool) -> None:
        self._note_active(tag, attrs)
        if self.skipping:
            if tag == self.skipping[-1] and not closed:
                self.skipping.append(tag)
            return
        if tag in DROPPED_WITH_CONTENT and not closed:
            self.skipping.append(tag)
            return
        if tag not in ALLOWED_TAGS:
            return  # the tag goes, its content stays
        kept = "".join(f' {name}="{html.escape(value, quote=True)}"'
                       for name, value in self._kept_attributes(tag, attrs))
        self.out.append(f"<{tag}{kept}>")
        if tag not in VOID_TAGS:
            self.open_tags.append(tag)

    def _note_active(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in ACTIVE_TAGS or any(name.startswith("on") or name == "srcdoc" or
                                     (name in URL_ATTRIBUTES and SCRIPT_URL.match(_url(value or "")))
                                     for name, value in attrs):
            self.active = True

    def _kept_attributes(self, tag: str, attrs: list[tuple[str, str | None]]) -> list[tuple[str, str]]:
        kept = []
        for name, value in attrs:
            if name not in ALLOWED_TAGS[tag] and name not in GLOBAL_ATTRIBUTES:
                continue
            value = value or ""
            if name == "style":
                declarations = safe_css_declarations(value)
                if declarations is None:
                    continue
                value = declarations
            elif name == "href" and not _link(value):
                continue
            elif name == "src" and not IMAGE_DATA_URL.match(_url(value)):
                continue  # only embedded images: a remote one is a request from the user's machine
            elif name == "id":
                value = ID_PREFIX + value
            kept.append((name, value))
        return kept

    def handle_endtag(self, tag: str) -> None:
        if self.skipping:
            if self.skipping == ["style"] and tag == "style":
                self._style_block("".join(self.style_text))
                self.style_text.clear()
            if tag == self.skipping[-1]:
                self.skipping.pop()
            return
        if tag not in self.open_tags:
            return
        while self.open_tags:
            inner = self.open_tags.pop()
            self.out.append(f"</{inner}>")
            if inner == tag:
                break

    def handle_data(self, data: str) -> None:
        if self.skipping == ["style"]:  # a <style> in allowed markup: kept if its CSS is safe
            self.style_text.append(data)
            return
        if self.skipping:
            return
        if risky_tex(data):
            self.risky_math = True
        self.out.append(html.escape(data, quote=True))

    def _style_block(self, css: str) -> None:
        scoped = scoped_css(css, self.scope)
        if scoped:
            self.out.append(f"<style>{scoped}</style>")
            self.styled = True


def _url(value: str) -> str:
    return URL_IGNORED.sub("", value)


def _link(value: str) -> bool:
    """A link the user may follow: the web, mail, or a place in this output."""
    url = _url(value).lower()
    return url.startswith(LINK_SCHEMES) or url.startswith("#")


def safe_css_declarations(css: str) -> str | None:
    """A style attribute's declarations, or None if they could load, run or cover anything."""
    css = CSS_COMMENT.sub("", css)
    return None if CSS_FORBIDDEN.search(css) else css.strip()


def scoped_css(css: str, scope: str) -> str | None:
    """A <style> block's rules, each selector confined to the output's wrapper (.scope), its id
    selectors renamed as the ids are; None if any rule cannot be read or is not safe."""
    css = CSS_COMMENT.sub("", css)
    if CSS_FORBIDDEN.search(css) or "&" in css:
        return None
    rules, position = [], 0
    while position < len(css):
        rule = CSS_RULE.match(css, position)
        if rule is None:
            return None if css[position:].strip() else "".join(rules)
        selectors = []
        for selector in rule.group(1).split(","):
            selector = selector.strip()
            if not selector or selector[0] in ">+~":
                return None  # a rule that would reach the wrapper's siblings
            selectors.append(f".{scope} " + re.sub(r"#(-?[A-Za-z_])", rf"#{ID_PREFIX}\1", selector))
        rules.append(f"{', '.join(selectors)} {{{rule.group(2).strip()}}}\n")
        position = rule.end()
    return "".join(rules)
