#!/usr/bin/env python
"""Django's command-line utility for the V100 inference portal."""

import os
import secrets
import sys
from pathlib import Path

# Pure calculations: they sign, store and serve nothing, so a fresh clone runs them without a
# SECRET_KEY. A random key for this one process cannot leak into anything that outlives it.
OFFLINE_COMMANDS = frozenset({"plan", "simulate", "bench"})

# What an unmigrated database answers (SQLite, PostgreSQL): a setup step, not a crash.
def _unmigrated(error: Exception) -> bool:
    text = str(error)
    return "no such table" in text or "no such column" in text or (
        "does not exist" in text and ('relation "' in text or "column " in text)
    )


def _read_run_env() -> None:
    """`make run` writes the settings it runs under (DEBUG, PORTAL_PORT) to var/.env, so the docs'
    `python manage.py …` beside it finds the same database and development key instead of stopping at
    "SECRET_KEY must be set". What the environment says wins; without the file nothing changes."""
    path = Path(os.environ.get("PORTAL_ENV_FILE") or Path(__file__).resolve().parent / "var" / ".env")
    if not path.is_file():
        return
    for line in path.read_text().splitlines():
        name, sep, value = line.strip().partition("=")
        if sep and name and not name.startswith("#"):
            os.environ.setdefault(name.strip(), value.strip())


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    _read_run_env()
    if len(sys.argv) > 1 and sys.argv[1] in OFFLINE_COMMANDS and not os.environ.get("SECRET_KEY"):
        os.environ["SECRET_KEY"] = secrets.token_urlsafe(50)
    from django.core.exceptions import ImproperlyConfigured
    from django.core.management import execute_from_command_line
    from django.db import DatabaseError

    try:
        execute_from_command_line(sys.argv)
    except ImproperlyConfigured as error:
        # A setting the operator must give (SECRET_KEY, a malformed URL): say which, not a traceback.
        sys.stderr.write(f"Configuration: {error}. docs/configuration.md lists every setting.\n")
        sys.exit(2)
    except DatabaseError as error:
        if not _unmigrated(error):
            raise
        sys.stderr.write(
            f"The database is not set up ({str(error).strip().splitlines()[0]}): "
            f"run `python manage.py migrate` first.\n"
        )
        sys.exit(1)


if __name__ == "__main__":
    main()
