"""The repository stands alone: nothing in it cites notes that are not in it.

The facts the code relies on live in docs/v100-field-guide.md and docs/architecture.md;
a citation of the outside notes they came from would send a reader to a file that
does not exist here.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Spelled in pieces so this file does not match itself.
OUTSIDE_NOTES = re.compile("|".join(("FIELD" + "_NOTES", r"DESIGN\.md", r"STYLE\.md")))


def tracked_files() -> list[Path]:
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True, text=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / name for name in listed.split("\0") if name]


def test_it_cites_no_notes_outside_the_repository():
    citing = []
    for path in tracked_files():
        if not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary files (screenshots) cite nothing
        for number, line in enumerate(text.splitlines(), start=1):
            if OUTSIDE_NOTES.search(line):
                citing.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    advice = "cite docs/v100-field-guide.md or docs/architecture.md instead:\n"
    assert citing == [], advice + "\n".join(citing)


def test_it_has_the_sections_the_code_cites():
    cited = set()
    for path in tracked_files():
        if path.suffix not in {".py", ".md", ".html"} or not path.is_file():
            continue
        text = path.read_text(encoding="utf-8")
        cited.update(re.findall(r"(v100-field-guide|architecture)\.md#([a-z0-9-]+)", text))
    assert cited, "nothing cites the docs"
    for doc, anchor in sorted(cited):
        headings = (ROOT / "docs" / f"{doc}.md").read_text(encoding="utf-8")
        slugs = {
            re.sub(r"[^a-z0-9 -]", "", heading.strip().lower()).replace(" ", "-")
            for heading in re.findall(r"^#+ (.+)$", headings, flags=re.MULTILINE)
        }
        assert anchor in slugs, f"docs/{doc}.md has no section #{anchor}"
