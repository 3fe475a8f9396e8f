"""`manage.py` run as production runs it: its own process, production settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers import ROOT

PRODUCTION = {
    "DJANGO_SETTINGS_MODULE": "portal.settings",
    "DEBUG": "false",
    "SECRET_KEY": "a-long-random-production-secret-key-0123456789-abcdefghijklmnop",
    "ALLOWED_HOSTS": "portal.example.internal",
    "DATABASE_URL": "sqlite:///:memory:",
    "PORTAL_REDIS_NAMESPACE": "portal-production",
}


def manage(*args: str, env: dict) -> subprocess.CompletedProcess:
    # Drop what tests/settings.py set for the test process itself.
    inherited = ("SECURE_", "SESSION_COOKIE_", "CSRF_COOKIE_", "REDIS_URL", "DJANGO_ALLOW_ASYNC_UNSAFE")
    clean = {k: v for k, v in os.environ.items() if k not in PRODUCTION and not k.startswith(inherited)}
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


LOAD_EACH = """
import json, os, runpy, sys
base = dict(os.environ)
out = []
for env in json.loads(sys.argv[1]):
    os.environ.clear(); os.environ.update(base); os.environ.update(env)
    try:
        runpy.run_path("portal/settings.py")
        out.append("")
    except Exception as error:  # ImproperlyConfigured, or whatever else stops the start
        out.append(f"{type(error).__name__}: {error}")
print(json.dumps(out))
"""


def settings_refusals(*changes: dict[str, str]) -> list[str]:
    """Load portal/settings.py under production settings plus each of `changes`, all in one process
    (a process each costs a Django start): the error each load stopped with, "" where it loaded.
    How manage.py reports such an error (one line, exit status 2) is tests/core/test_settings_bounds.py's.
    """
    inherited = ("SECURE_", "SESSION_COOKIE_", "CSRF_COOKIE_", "REDIS_URL", "DJANGO_ALLOW_ASYNC_UNSAFE")
    clean = {k: v for k, v in os.environ.items() if k not in PRODUCTION and not k.startswith(inherited)}
    result = subprocess.run(
        [sys.executable, "-c", LOAD_EACH, json.dumps(list(changes))],
        cwd=ROOT,
        env={**clean, **PRODUCTION},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(result.stdout)


READ_EACH = """
import json, os, runpy, sys
base = dict(os.environ)
names = json.loads(sys.argv[2])
out = []
for env in json.loads(sys.argv[1]):
    os.environ.clear(); os.environ.update(base); os.environ.update(env)
    loaded = runpy.run_path("portal/settings.py")
    out.append({name: loaded[name] for name in names})
print(json.dumps(out))
"""


def settings_values(names: list[str], *changes: dict[str, str]) -> list[dict]:
    """Load portal/settings.py under production settings plus each of `changes`: the named values."""
    inherited = ("SECURE_", "SESSION_COOKIE_", "CSRF_COOKIE_", "REDIS_URL", "DJANGO_ALLOW_ASYNC_UNSAFE")
    strip = ("PORTAL_PORT", "PORTAL_HOST", "BENCHMARK_GATEWAY_URL")  # this shell's own, if any
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in PRODUCTION and k not in strip and not k.startswith(inherited)
    }
    result = subprocess.run(
        [sys.executable, "-c", READ_EACH, json.dumps(list(changes)), json.dumps(names)],
        cwd=ROOT,
        env={**clean, **PRODUCTION},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(result.stdout)
