"""The repository stands alone: nothing in it cites notes that are not in it; and its apps form
layers, each importing only the apps below it.

The facts the code relies on live in docs/v100-field-guide.md and docs/architecture.md;
a citation of the outside notes they came from would send a reader to a file that
does not exist here. And the apps keep their layers (docs/architecture.md#layers): core,
at the bottom, imports no other app; the dashboard, at the top, is imported by none.

The layers hold for strings too (docs/architecture.md#beyond-imports): model labels, migration
dependencies, URL names, template names and task names sent by name point down, except the few
listed with their reasons in ALLOWED_UPWARD (Usage.deployment and its two migrations; two page
links by name). Not seen: reverse relations, `related_model`, signal receivers. inference/ imports
neither Django nor the portal.
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


# core's Redis package is the mechanism every app shares (docs/architecture.md, "Bottom and top");
# what serves the gateway alone (its limiter, scripts and connection) lives in portal/gateway/.
CORE_REDIS_MODULES = {"__init__.py", "client.py", "keys.py", "scripts.py"}


def test_core_redis_holds_only_the_mechanism():
    found = {path.name for path in (PORTAL / "core" / "redis").glob("*.py")}
    assert found == CORE_REDIS_MODULES, (
        "portal/core/redis/ is the client factory, the key namespace and the script machinery; "
        f"put what one app alone uses in that app (new here: {sorted(found - CORE_REDIS_MODULES)})"
    )
    # Each script left in core serves an app below the gateway: none of them is the gateway's.
    core_scripts = (PORTAL / "core" / "redis" / "scripts.py").read_text()
    users = {
        name: {
            app
            for app in APPS
            if app != "core"
            for path in (PORTAL / app).rglob("*.py")
            if re.search(rf"\b{name}\b", path.read_text())
        }
        for name in re.findall(r"^([A-Z_]+) = build_script\(", core_scripts, re.M)
    }
    assert users and all(apps and "gateway" not in apps for apps in users.values()), users


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
    "batches",
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


# --- Layers beyond imports: strings that name another app --------------------------------------------
# An app can lean on one above it without an import: a model named by label ("app.Model"), a migration
# depending on another app's, a URL name (reverse(), redirect(), {% url %}), a template of another app,
# a task sent by name. Each counts as a reference to that app and must point down, like an import.
# The project itself (portal/settings.py, portal/urls.py, portal/celery.py, and the templates outside
# any app's folder: base.html's navigation, login, the CSRF page) sits above every app and is not checked.

TEMPLATES = ROOT / "templates"
RANK = {app: i for i, app in enumerate(LAYERS)}
# The only references that may point up, as (app, what) → why (docs/architecture.md#layers).
ALLOWED_UPWARD = {
    # A usage row records which deployment served it. teams owns the usage record and sits below
    # deployments (a deployment belongs to a team), so the foreign key is by label, without a database
    # constraint (the flush checks the ids itself), and teams' migrations 0002 and 0006 depend on
    # deployments' for it: the one model reference that points up.
    ("teams", "model deployments.Deployment"): "Usage.deployment",
    ("teams", "migration deployments"): "Usage.deployment",
    # Links to a deployment's page by its name (the GPU holder on a node's page, the acceptance's
    # burn-in deployment): benchmarks has the name, not the row, and the page is observability's.
    ("benchmarks", "url observability:deployment-detail"): "node page: a deployment's page by name",
    # A deployment's page lists the rollouts in progress to or from it, with a link to each.
    ("observability", "url rollouts:rollout-detail"): "deployment page: rollouts in progress",
}


def app_files(app: str, suffix: str = ".py") -> list[Path]:
    return sorted((PORTAL / app).rglob(f"*{suffix}"))


def url_namespaces() -> dict[str, str]:
    """URL namespace → the app whose urls module declares it (`nodes` is benchmarks')."""
    owners = {}
    for app in APPS:
        for path in app_files(app):
            found = re.search(r'^app_name = "([\w-]+)"', path.read_text(encoding="utf-8"), re.MULTILINE)
            if found:
                owners[found.group(1)] = app
    return owners


def task_names() -> dict[str, str]:
    """Celery task name → the app that defines it (an unnamed shared_task is named by its module)."""
    owners = {}
    for app in APPS:
        for path in app_files(app):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if not isinstance(node, ast.FunctionDef):
                    continue
                for decorator in node.decorator_list:
                    call = decorator if isinstance(decorator, ast.Call) else None
                    target = call.func if call else decorator
                    if getattr(target, "id", getattr(target, "attr", None)) not in {"shared_task", "task"}:
                        continue
                    named = [k.value.value for k in (call.keywords if call else []) if k.arg == "name"]
                    owners[named[0] if named else f"{module}.{node.name}"] = app
    return owners


URL_CALLS = {"reverse", "reverse_lazy", "redirect", "resolve_url"}
MODEL_LABEL = re.compile(r"^([a-z_]+)\.([A-Z]\w*)$")
TEMPLATE_NAME = re.compile(r"^([a-z_]+)/[\w/]+\.html$")


def url_app(name: str, namespaces: dict[str, str]) -> str | None:
    namespace, _, view = name.partition(":")
    if namespace == "admin":  # an admin page of a model belongs to the model's app: admin:teams_team_change
        return next((app for app in APPS if view.startswith(f"{app}_")), None)
    return namespaces.get(namespace)


def string_references(source: str, namespaces: dict[str, str], tasks: dict[str, str]) -> set[tuple[str, str]]:
    """(app, what) for every app a module names in its strings: model labels, URL names, templates,
    task names (f"deployments.{action}" counts by its prefix), migration dependencies."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
            if (label := MODEL_LABEL.match(text)) and label.group(1) in APPS:
                found.add((label.group(1), f"model {text}"))
            if (template := TEMPLATE_NAME.match(text)) and template.group(1) in APPS:
                found.add((template.group(1), f"template {text}"))
            if text in tasks:
                found.add((tasks[text], f"task {text}"))
        elif isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            prefix = str(node.values[0].value)
            for name, app in tasks.items():
                if "." in prefix and name.startswith(prefix):
                    found.add((app, f"task {prefix}…"))
        elif isinstance(node, ast.Call):
            name = getattr(node.func, "id", getattr(node.func, "attr", None))
            first = node.args[0] if node.args else None
            text = first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None
            if name in URL_CALLS and text and ":" in text and (app := url_app(text, namespaces)):
                found.add((app, f"url {text}"))
            if name == "get_model" and len(node.args) == 2 and text in APPS:  # apps.get_model("app", "Model")
                found.add((text, f"model {text}.{getattr(node.args[1], 'value', '?')}"))
        elif isinstance(node, ast.Assign) and "dependencies" in {getattr(t, "id", "") for t in node.targets}:
            for item in getattr(node.value, "elts", []):
                label = getattr(item, "elts", [None])[0]
                if isinstance(label, ast.Constant) and label.value in APPS:
                    found.add((label.value, f"migration {label.value}"))
    return found


def template_references(text: str, namespaces: dict[str, str]) -> set[tuple[str, str]]:
    """(app, what) for the {% url %} names and the included or extended templates of a template."""
    found = set()
    for name in re.findall(r"{%\s*url\s+[\"']([\w-]+:[\w-]+)[\"']", text):
        if app := url_app(name, namespaces):
            found.add((app, f"url {name}"))
    for name in re.findall(r"{%\s*(?:include|extends)\s+[\"']([^\"']+)[\"']", text):
        if (template := TEMPLATE_NAME.match(name)) and template.group(1) in APPS:
            found.add((template.group(1), f"template {name}"))
    return found


def template_app(path: Path) -> str | None:
    """templates/<app>/… (and the admin's templates/admin/<app>/…) belong to that app."""
    parts = path.relative_to(TEMPLATES).parts
    if parts[0] == "admin" and len(parts) > 2:
        parts = parts[1:]
    return parts[0] if len(parts) > 1 and parts[0] in APPS else None


def app_references() -> list[tuple[str, str, str, str]]:
    """(app, referenced app, file, what) for every string reference between two apps."""
    namespaces, tasks = url_namespaces(), task_names()
    found = []
    for app in APPS:
        for path in app_files(app):
            for other, what in string_references(path.read_text(encoding="utf-8"), namespaces, tasks):
                found.append((app, other, str(path.relative_to(ROOT)), what))
    for path in sorted(TEMPLATES.rglob("*.html")):
        if app := template_app(path):
            for other, what in template_references(path.read_text(encoding="utf-8"), namespaces):
                found.append((app, other, str(path.relative_to(ROOT)), what))
    return [(app, other, where, what) for app, other, where, what in found if app != other]


def test_the_string_guard_sees_each_kind_of_reference():
    """It would pass vacuously if a pattern matched nothing."""
    namespaces, tasks = url_namespaces(), task_names()
    assert namespaces["nodes"] == "benchmarks" and tasks["deployments.start"] == "deployments"
    assert tasks["portal.teams.tasks.usage_flush"] == "teams"  # named by its module
    module = """
team = models.ForeignKey("teams.Team", on_delete=models.CASCADE)
Quota = apps.get_model("registry", "ModelVersion")
dependencies = [("inventory", "0001_initial")]
app.send_task("portal.teams.tasks.usage_flush", queue="control")
send_to_node(node, f"deployments.{action}", args=[pk])
url = reverse("nodes:detail", args=[name])
back = redirect("admin:audit_auditevent_changelist")
page = render(request, "dashboard/home.html", {})
"""
    assert string_references(module, namespaces, tasks) == {
        ("teams", "model teams.Team"),
        ("registry", "model registry.ModelVersion"),
        ("inventory", "migration inventory"),
        ("teams", "task portal.teams.tasks.usage_flush"),
        ("deployments", "task deployments.…"),
        ("benchmarks", "url nodes:detail"),
        ("audit", "url admin:audit_auditevent_changelist"),
        ("dashboard", "template dashboard/home.html"),
    }
    template = """{% extends "base.html" %}{% include "inventory/_agent_badge.html" %}
<a href="{% url 'observability:deployment-detail' d.name %}">"""
    assert template_references(template, namespaces) == {
        ("inventory", "template inventory/_agent_badge.html"),
        ("observability", "url observability:deployment-detail"),
    }
    # And on the tree itself: the apps name each other by model, migration, URL and template.
    kinds = {what.split()[0] for _app, _other, _where, what in app_references()}
    assert {"model", "migration", "url", "template"} <= kinds


def test_no_app_names_an_app_above_it():
    references = app_references()
    upward = sorted(
        f"{where}: {what} ({app} → {other})"
        for app, other, where, what in references
        if RANK[other] > RANK[app] and (app, what) not in ALLOWED_UPWARD
    )
    advice = (
        "an app names one above it by string (docs/architecture.md#layers); send the link, task or"
        " model from the higher app, or list a reasoned exception in ALLOWED_UPWARD:\n"
    )
    assert upward == [], advice + "\n".join(upward)
    # An exception that no longer occurs is taken off the list.
    assert set(ALLOWED_UPWARD) <= {(app, what) for app, _other, _where, what in references}


def test_inference_imports_neither_django_nor_the_portal():
    """inference/ is the engine side: it runs without Django (the load generator, the simulator, the
    supervisor's process handling), so the portal stores what it returns, never the other way round."""
    offending = []
    for path in sorted((ROOT / "inference").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            offending += [
                f"{path.relative_to(ROOT)}:{node.lineno}: {name}"
                for name in names
                if name.split(".")[0] in {"django", "portal", "rest_framework", "celery"}
            ]
    assert offending == [], "inference/ stays free of Django and the portal:\n" + "\n".join(offending)


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
