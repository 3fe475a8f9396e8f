"""The README's table of contents is the README's: every section and subsection is listed, in order,
and every entry leads to a heading that exists (issue 38: 1,822 lines and no way to find a section)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
ENTRY = re.compile(r"^(?P<indent> *)- \[(?P<title>[^\]]+)\]\(#(?P<anchor>[^)]+)\)$")


def headings(text: str) -> list[tuple[int, str]]:
    """`##` and `###` headings outside code blocks (a shell comment in a block is no heading)."""
    found, in_code = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and (match := re.match(r"^(#{2,3}) (.+)$", line)):
            found.append((len(match.group(1)), match.group(2).strip()))
    return found


def anchor(title: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def contents(text: str) -> list[tuple[int, str, str]]:
    block = text.split("## Contents", 1)[1].split("\n## ", 1)[0]
    return [
        (2 if not m.group("indent") else 3, m.group("title"), m.group("anchor"))
        for line in block.splitlines()
        if (m := ENTRY.match(line))
    ]


def test_the_readme_lists_every_section_in_its_contents_in_order():
    text = README.read_text()
    listed = [(level, title) for level, title, _ in contents(text)]
    assert listed == [(level, title) for level, title in headings(text) if title != "Contents"]


def test_every_contents_entry_leads_to_its_heading():
    text = README.read_text()
    for _, title, link in contents(text):
        assert link == anchor(title), f"{title!r} links to #{link}, its heading's anchor is #{anchor(title)}"
