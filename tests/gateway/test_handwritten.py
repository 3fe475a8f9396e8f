"""The list of hand-written layers (portal/gateway/handwritten.py) stays true: every test it
names exists, every attribute it relies on is still in the installed library, and the installed
versions are those the layers were last checked against."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import inspect
from functools import cache
from pathlib import Path

import pytest

from portal.gateway.handwritten import LAYERS, Kind, Reliance

ROOT = Path(__file__).resolve().parents[2]
RELIANCES = [(layer.name, r) for layer in LAYERS for r in layer.relies_on if r.kind is not Kind.BEHAVIOUR]


@cache
def _test_names(path: str) -> frozenset[str]:
    tree = ast.parse((ROOT / path).read_text())
    return frozenset(
        node.name for node in tree.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    )


def test_it_names_each_layers_module_and_tests_that_exist():
    missing = [
        f"{layer.name}: {test}"
        for layer in LAYERS
        for test in layer.tests
        if not (ROOT / test.split("::")[0]).exists()
        or test.split("::")[1] not in _test_names(test.split("::")[0])
    ]
    assert not missing, "named tests that do not exist:\n" + "\n".join(missing)
    assert all((ROOT / layer.module).exists() for layer in LAYERS)
    assert all(layer.tests and layer.relies_on for layer in LAYERS)


def _owner(reliance: Reliance) -> object:
    owner: object = importlib.import_module(reliance.module)
    for part in filter(None, reliance.owner.split(".")):
        owner = getattr(owner, part)
    return owner


def _has(reliance: Reliance) -> bool:
    owner = _owner(reliance)
    if not reliance.instance:
        return hasattr(owner, reliance.attribute)
    # Set in a method (`self.<name> = ...`): look in the source of the class and its bases.
    classes = inspect.getmro(owner) if inspect.isclass(owner) else (owner,)
    needle = f"self.{reliance.attribute} ="
    return any(needle in inspect.getsource(cls) for cls in classes if cls is not object)


@pytest.mark.parametrize(
    ("layer", "reliance"), RELIANCES, ids=[f"{r.module}.{r.owner}.{r.attribute}" for _, r in RELIANCES]
)
def test_each_attribute_a_layer_relies_on_is_still_in_the_installed_library(layer, reliance):
    assert _has(reliance), (
        f"{layer} relies on {reliance.module}:{reliance.owner}.{reliance.attribute} ({reliance.why}), "
        "which the installed library no longer has: read the layer again before upgrading"
    )


def test_the_installed_versions_are_those_the_layers_were_checked_against():
    moved = [
        f"{layer.name} ({layer.module}): checked with {name} {checked}, installed {installed}"
        for layer in LAYERS
        for name, checked in layer.checked_with.items()
        if (installed := importlib.metadata.version(name)) != checked
    ]
    assert not moved, (
        "A library under a hand-written layer was upgraded. Read the layer's reliances, run its tests "
        "(portal/gateway/handwritten.py names them), then set checked_with to the new version:\n"
        + "\n".join(moved)
    )


def test_a_removed_attribute_would_be_caught():
    # The check itself can fail: a name that never existed is reported missing.
    ghost = Reliance(
        "redis", "redis.asyncio.connection", "AbstractConnection", "_no_such", Kind.PRIVATE, "", True
    )
    assert not _has(ghost)
    assert _has(
        Reliance("redis", "redis.asyncio.connection", "AbstractConnection", "_writer", Kind.PRIVATE, "", True)
    )
