"""Every relative link of the README and of the pages in docs/ leads somewhere: the file exists and, for a
``#anchor``, the page it names has a heading with that anchor, as GitHub derives anchors from headings."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[([^\]]*)\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")


def prose_lines(page: Path) -> list[str]:
    """The lines of a page outside its fenced code blocks (where a `#` starts a comment, not a heading)."""
    lines, fenced = [], False
    for line in page.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text (code marks and link targets gone) in lower case, every
    character that is not a letter, a digit, `_`, `-` or a space dropped, then each space made a `-`."""
    text = LINK.sub(lambda match: match.group(1), heading)
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor; a repeated one gets `-1`, `-2`, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose_lines(page):
        match = HEADING.match(line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    return out


def links(page: Path) -> list[str]:
    """The targets of the page's links and images, outside code blocks and code spans."""
    return [match.group(2) for line in prose_lines(page) for match in LINK.finditer(CODE_SPAN.sub("``", line))]


def test_slug_follows_github():
    assert slug("The first hour: from the demo's problem to a fix that works") == (
        "the-first-hour-from-the-demos-problem-to-a-fix-that-works"
    )
    assert slug("Debugging FP8 training (config namespace `transformer_engine`)") == (
        "debugging-fp8-training-config-namespace-transformer_engine"
    )
    assert slug("Weights & Biases") == "weights--biases"
    assert slug("Block-scaled recipes: MXFP8, NVFP4") == "block-scaled-recipes-mxfp8-nvfp4"
    assert slug("Reading [the report](report.md)") == "reading-the-report"


def test_every_page_is_in_the_readme_map():
    targets = {unquote(target.split("#")[0]) for target in links(ROOT / "README.md")}
    assert {f"docs/{page.name}" for page in PAGES[1:]} <= targets


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page):
    checked, broken = 0, []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto: ...: not ours to check
            continue
        path, _, anchor = unquote(target).partition("#")
        destination = (page.parent / path).resolve() if path else page
        checked += 1
        if not destination.exists():
            broken.append(f"{target}: no file {destination}")
        elif anchor and (destination.suffix != ".md" or anchor not in anchors(destination)):
            broken.append(f"{target}: no heading with anchor #{anchor} in {destination.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)
    assert checked or page.name != "README.md"
