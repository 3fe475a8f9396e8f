"""The repository stands alone: nothing in it cites notes that are not in it; and its apps form
layers, each importing only the apps below it.

The facts the code relies on live in docs/v100-field-guide.md and docs/architecture.md;
a citation of the outside notes they came from would send a reader to a file that
does not exist here. And the apps keep their layers (docs/architecture.md#layers): core,
at the bottom, imports no other app; the dashboard, at the top, is imported by none.
"""

from __future__ import annotations

import ast
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


PORTAL = ROOT / "portal"
APPS = sorted(path.parent.name for path in PORTAL.glob("*/apps.py"))


def portal_imports(path: Path) -> set[str]:
    """Every portal module `path` imports, at the top or inside a function, as a dotted name."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the file's own package
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            # `from portal import teams` imports the app itself
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        found.update(name for name in names if name.split(".")[0] == "portal")
    return found


def app_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in APPS else None


def test_it_finds_the_apps_and_lazy_imports():
    assert {"core", "dashboard", "teams", "gateway"} <= set(APPS)
    # The guard below would pass vacuously if it missed imports inside functions.
    lazy = portal_imports(PORTAL / "dashboard" / "tasks.py")
    assert "portal.dashboard.services.retention_prune" in lazy


def test_core_imports_no_other_app():
    reaching_up = [
        f"{path.relative_to(ROOT)}: {module}"
        for path in sorted((PORTAL / "core").rglob("*.py"))
        for module in sorted(portal_imports(path))
        if app_of(module) not in (None, "core")
    ]
    advice = "core is the bottom layer; move what needs other apps to them, or to portal/dashboard:\n"
    assert reaching_up == [], advice + "\n".join(reaching_up)


def test_no_app_imports_the_dashboard():
    reaching_down = [
        f"{path.relative_to(ROOT)}: {module}"
        for app in APPS
        if app != "dashboard"
        for path in sorted((PORTAL / app).rglob("*.py"))
        for module in sorted(portal_imports(path))
        if app_of(module) == "dashboard"
    ]
    assert reaching_down == [], "the dashboard is the top layer:\n" + "\n".join(reaching_down)


# --- Layers: each app imports only the apps below it (docs/architecture.md#layers) -----------------

LAYERS = (
    "core",
    "audit",
    "inventory",
    "registry",
    "teams",
    "deployments",
    "benchmarks",
    "observability",
    "rollouts",
    "gateway",
    "playground",
    "dashboard",
)


def app_imports() -> set[tuple[str, str]]:
    """(importer, imported) for every import of another app in an app's code, lazy ones included."""
    edges = set()
    for app in APPS:
        for path in (PORTAL / app).rglob("*.py"):
            if "migrations" in path.parts:
                continue  # migrations name other apps' models by label, never by import
            others = {app_of(module) for module in portal_imports(path)} - {None, app}
            edges.update((app, other) for other in others)
    return edges


def test_every_app_has_a_layer():
    assert set(APPS) == set(LAYERS)


def test_no_app_imports_an_app_above_it():
    rank = {app: i for i, app in enumerate(LAYERS)}
    upward = sorted(f"{a} → {b}" for a, b in app_imports() if rank[b] > rank[a])
    assert upward == [], "an app imports one above it (docs/architecture.md#layers):\n" + "\n".join(upward)


def test_node_tasks_are_sent_by_name_never_imported():
    """Services and the agent send with portal.inventory.dispatch, so no module imports a tasks module
    (which is what made services → tasks → agent → services a cycle). Commands may run a task's
    function in their own process; a benchmark run goes to its own queue, not a node's."""
    importers = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "portal").rglob("*.py")
        if "management" not in path.parts
        if re.search(r"^\s*from\s+(?:portal\.\w+)?\.tasks\s+import", path.read_text(), re.MULTILINE)
    ]
    assert importers == []
