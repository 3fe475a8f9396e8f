"""`manage.py` run as production runs it: its own process, production settings."""

from __future__ import annotations

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
