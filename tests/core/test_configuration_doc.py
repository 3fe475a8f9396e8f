"""docs/configuration.md lists every environment variable portal/settings.py reads (issue 39)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# env.str("X"…), env_number("X"…), env_bool("X"…), env_networks("X"), "X" in env, …
READ = re.compile(
    r'\benv(?:_\w+)?(?:\.\w+)?\(\s*"(?P<name>[A-Z][A-Z0-9_]+)"'
    r'|"(?P<tested>[A-Z][A-Z0-9_]+)" (?:not )?in env\b'
)
ROW = re.compile(r"^\| `([A-Z][A-Z0-9_]+)` \|", re.MULTILINE)


def variables_read(source: str) -> set[str]:
    return {m.group("name") or m.group("tested") for m in READ.finditer(source)}


def test_every_variable_settings_reads_is_in_the_configuration_doc():
    read = variables_read((ROOT / "portal" / "settings.py").read_text())
    documented = set(ROW.findall((ROOT / "docs" / "configuration.md").read_text()))
    assert len(read) > 100  # the pattern still finds what settings.py reads
    assert read - documented == set()


def test_the_pattern_finds_each_way_settings_reads_a_variable():
    source = """
X = env.str("A_STR", default="")
Y = env_number(
    "B_NUMBER", default=1, minimum=1)
Z = env_bool("C_BOOL", default=False)
N = env_networks("D_NETWORKS")
if "E_TESTED" not in env: pass
W = env.list("F_LIST", default=[])
"""
    assert variables_read(source) == {"A_STR", "B_NUMBER", "C_BOOL", "D_NETWORKS", "E_TESTED", "F_LIST"}
