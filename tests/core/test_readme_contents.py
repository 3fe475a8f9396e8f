"""The README is a front door and the docs a map (issue 39): the README's contents list every
section in order, and every relative link in README.md and docs/*.md leads to a file that exists
and, with an #anchor, to a heading that file has."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
ENTRY = re.compile(r"^(?P<indent> *)- \[(?P<title>[^\]]+)\]\(#(?P<anchor>[^)]+)\)$")
# [text](target) and ![alt](target), the target up to the first space or closing parenthesis
LINK = re.compile(r"!?\[[^\]]*\]\((?P<target>[^)\s]+)(?: \"[^\"]*\")?\)")


def prose(text: str) -> list[str]:
    """The lines outside fenced code blocks (a comment in a block is no heading, a link there no link)."""
    lines, in_code = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
        elif not in_code:
            lines.append(line)
    return lines


def headings(text: str, levels: str = "2,3") -> list[tuple[int, str]]:
    found = []
    for line in prose(text):
        match = re.match(r"^(#{1,6}) (.+?)\s*#*$", line)
        if match and str(len(match.group(1))) in levels.split(","):
            found.append((len(match.group(1)), match.group(2).strip()))
    return found


def anchor(title: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a Markdown file, with GitHub's -1, -2 … for repeated titles."""
    seen: dict[str, int] = {}
    result = set()
    for _, title in headings(path.read_text(), "1,2,3,4,5,6"):
        base = anchor(title)
        count = seen.get(base, 0)
        result.add(base if count == 0 else f"{base}-{count}")
        seen[base] = count + 1
    return result


def contents(text: str) -> list[tuple[int, str, str]]:
    block = text.split("## Contents", 1)[1].split("\n## ", 1)[0]
    return [
        (2 if not m.group("indent") else 3, m.group("title"), m.group("anchor"))
        for line in block.splitlines()
        if (m := ENTRY.match(line))
    ]


def relative_links(path: Path) -> list[str]:
    text = "\n".join(re.sub(r"`[^`]*`", "", line) for line in prose(path.read_text()))
    return [
        m.group("target")
        for m in LINK.finditer(text)
        if not re.match(r"^[a-z][a-z0-9+.-]*:", m.group("target"))  # http:, https:, mailto:
    ]


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    broken = []
    for target in relative_links(path):
        file_part, _, fragment = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{target}: no file {linked.relative_to(root)}")
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
            broken.append(f"{target}: {linked.relative_to(root)} has no heading #{fragment}")
    return broken


def test_the_readme_lists_every_section_in_its_contents_in_order():
    text = README.read_text()
    listed = [(level, title) for level, title, _ in contents(text)]
    assert listed == [(level, title) for level, title in headings(text) if title != "Contents"]


def test_every_contents_entry_leads_to_its_heading():
    text = README.read_text()
    for _, title, link in contents(text):
        assert link == anchor(title), f"{title!r} links to #{link}, its heading's anchor is #{anchor(title)}"


def test_the_readme_stays_a_front_door():
    assert len(README.read_text().splitlines()) <= 220


def test_every_relative_link_in_the_readme_and_the_docs_resolves():
    files = [README, *sorted((ROOT / "docs").glob("*.md"))]
    broken = {str(path.relative_to(ROOT)): found for path in files if (found := broken_links(path))}
    assert broken == {}


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## A `code` heading: yes\n")
    page.write_text(
        "[ok](other.md#a-code-heading-yes) [gone](missing.md) [no heading](other.md#nowhere)\n"
        "```\n[in a code block](ignored.md)\n```\n[web](https://example.com)\n"
    )
    assert [line.split(":")[0] for line in broken_links(page, root=tmp_path)] == [
        "missing.md",
        "other.md#nowhere",
    ]
