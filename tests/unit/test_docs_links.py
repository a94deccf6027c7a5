"""The docs hold together: README.md stays a front door, and no page links to a file that is not there."""

from __future__ import annotations

import os
import re

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(ROOT, "README.md")
PAGES = [README, *sorted(os.path.join(ROOT, "docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                         if f.endswith(".md"))]
README_MAX_LINES = 400

# [text](target) and ![alt](target); a target ends at whitespace or ")", an optional "title" after it.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def links(path: str) -> list[tuple[int, str]]:
    """(line number, target) of every Markdown link outside fenced code blocks and inline code."""
    out = []
    fenced = False
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if FENCE.match(line):
                fenced = not fenced
                continue
            if fenced:
                continue
            text = re.sub(r"`[^`]*`", "", line)
            out.extend((number, target) for target in LINK.findall(text))
    return out


def relative(target: str) -> bool:
    return not (re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_relative_link_points_to_a_file(page):
    missing = []
    for number, target in links(page):
        if not relative(target):
            continue
        path = target.split("#", 1)[0].split("?", 1)[0]
        if not os.path.exists(os.path.normpath(os.path.join(os.path.dirname(page), path))):
            missing.append(f"{os.path.relpath(page, ROOT)}:{number}: {target}")
    assert not missing, "\n".join(missing)


def test_the_readme_is_a_front_door():
    with open(README, encoding="utf-8") as f:
        lines = sum(1 for _ in f)
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; topics belong in docs/ (at most {README_MAX_LINES})"


def test_every_docs_page_is_linked_from_the_readme():
    targets = {os.path.normpath(os.path.join(ROOT, t.split("#", 1)[0])) for _, t in links(README) if relative(t)}
    unlinked = [os.path.relpath(p, ROOT) for p in PAGES[1:] if p not in targets]
    assert not unlinked, unlinked
