"""Every relative link in README.md and docs/*.md reaches a file that exists and, when it names
an anchor, a heading of that file, as GitHub renders it: the README is short and points into
docs/, so a page renamed or a heading reworded would otherwise leave the reader at a dead end.
And every page of docs/ is linked from the README, so none is left where nobody finds it."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.MULTILINE)


def prose(markdown: str) -> str:
    """The text links can live in: fenced blocks and inline code are not rendered as links."""
    return INLINE_CODE.sub("", FENCE.sub("", markdown))


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text lower-cased, with everything but letters,
    digits, spaces, hyphens and underscores dropped, and each space made a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = text.replace("`", "").lower()
    kept = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return kept.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Every anchor of a page; a repeated heading gets -1, -2... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for _, text in HEADING.findall(FENCE.sub("", markdown)):
        slug = github_slug(text)
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def dead_links(page: Path) -> list[str]:
    """The relative links of one page whose file or anchor does not exist, as 'target: why'."""
    dead = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ... not ours to check
            continue
        path_part, _, anchor = target.partition("#")
        linked = (page.parent / unquote(path_part)).resolve() if path_part else page
        if not linked.is_file():
            dead.append(f"{target}: no file {linked}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked.read_text()):
            dead.append(f"{target}: no heading with anchor #{anchor} in {linked.name}")
    return dead


def test_every_relative_link_reaches_its_file_and_heading() -> None:
    assert len(PAGES) > 1, PAGES
    dead = {page.relative_to(ROOT).as_posix(): dead_links(page) for page in PAGES}
    assert {page: links for page, links in dead.items() if links} == {}


def test_every_docs_page_is_linked_from_the_readme() -> None:
    readme = prose((ROOT / "README.md").read_text())
    readme_links = {target.partition("#")[0] for target in LINK.findall(readme)}
    pages = {page.relative_to(ROOT).as_posix() for page in PAGES if page.parent == ROOT / "docs"}
    assert pages - readme_links == set()


def test_anchors_are_spelled_as_github_spells_them() -> None:
    """The slug rule the link check relies on, on headings of the kinds these pages use."""
    assert github_slug("Pause, resume, fork: the `%sandbox` magics") == "pause-resume-fork-the-sandbox-magics"
    assert github_slug("Egress: the sandbox's outbound network, on an allowlist") == (
        "egress-the-sandboxs-outbound-network-on-an-allowlist")
    assert github_slug("Managed processes (local engine)") == "managed-processes-local-engine"
    assert github_slug("Command line: `sandbox-kernel` subcommands") == "command-line-sandbox-kernel-subcommands"
    assert anchors("# A\n## Notes\n### Notes\n```\n# not a heading\n```\n") == {"a", "notes", "notes-1"}
