"""The test kit's rules: helpers live in tests/helpers, and the markers mean what they say."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from devtools import wait_until
from tests.helpers import ROOT, plugin

TESTS = ROOT / "tests"
ALLOWED = ("tests.helpers", "tests.settings")


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every `tests.…` module a file imports, relative imports resolved."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            found.append((node.lineno, module))
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
    # Code run in a subprocess (`manage.py shell -c ...`) is a string: read its imports too.
    for line, text in enumerate(path.read_text().splitlines(), start=1):
        if match := re.match(r"\s*from (tests\.[\w.]+) import ", text):
            found.append((line, match.group(1)))
    return sorted({(line, module) for line, module in found if module.split(".")[0] == "tests"})


def test_no_test_imports_from_another_test_module_or_another_packages_conftest():
    offences = []
    for path in sorted(TESTS.rglob("*.py")):
        own_conftest = ".".join(path.relative_to(ROOT).parts[:-1]) + ".conftest"
        inside_helpers = path.is_relative_to(TESTS / "helpers")
        for line, module in _imported_modules(path):
            allowed = module.startswith(ALLOWED) or (module == own_conftest and not inside_helpers)
            if not allowed:
                offences.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert offences == [], "import helpers from tests.helpers instead:\n" + "\n".join(offences)


def test_the_top_of_tests_holds_no_helper_modules():
    assert sorted(p.name for p in TESTS.glob("*.py")) == ["__init__.py", "conftest.py", "settings.py"]


def test_the_root_conftest_registers_the_kits_plugins_and_they_exist():
    tree = ast.parse((TESTS / "conftest.py").read_text())
    [registered] = [
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "pytest_plugins"
    ]
    assert "tests.helpers.plugin" in registered
    for module in registered:
        assert (ROOT / Path(*module.split("."))).with_suffix(".py").exists(), module


def _item(*markers):
    marks = {m.name: m for m in markers}
    return SimpleNamespace(get_closest_marker=marks.get)


def _database_is(monkeypatch, vendor: str) -> None:
    from django.db import connections

    monkeypatch.setattr(type(connections["default"]), "vendor", vendor)


@pytest.fixture
def on_sqlite(monkeypatch):
    _database_is(monkeypatch, "sqlite")


def test_a_postgres_test_skips_on_another_database_outside_ci(on_sqlite, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="needs PostgreSQL"):
        plugin.pytest_runtest_setup(_item(pytest.mark.postgres.mark))


def test_a_postgres_test_fails_on_another_database_in_ci(on_sqlite, monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="needs PostgreSQL"):
        plugin.pytest_runtest_setup(_item(pytest.mark.postgres(reason="an agent").mark))


def test_a_postgres_test_runs_on_postgresql_and_unmarked_tests_are_left_alone(monkeypatch):
    monkeypatch.setenv("CI", "true")
    _database_is(monkeypatch, "postgresql")
    plugin.pytest_runtest_setup(_item(pytest.mark.postgres.mark))
    _database_is(monkeypatch, "sqlite")
    plugin.pytest_runtest_setup(_item(pytest.mark.slow.mark))


def test_wait_until_returns_the_first_truthy_answer():
    answers = iter([None, 0, [], "ready"])
    assert wait_until(lambda: next(answers), what="ready", interval_s=0) == "ready"


def test_wait_until_names_what_it_waited_for_at_the_deadline():
    with pytest.raises(AssertionError, match=r"^not the moon after 0\.05 s$"):
        wait_until(lambda: False, what="the moon", timeout_s=0.05, interval_s=0.01)
