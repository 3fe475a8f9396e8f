#!/usr/bin/env python
"""Django's command-line utility for the V100 inference portal."""

import os
import secrets
import sys

# Pure calculations: they sign, store and serve nothing, so a fresh clone runs them without a
# SECRET_KEY. A random key for this one process cannot leak into anything that outlives it.
OFFLINE_COMMANDS = frozenset({"plan", "simulate", "bench"})

# What an unmigrated database answers (SQLite, PostgreSQL): a setup step, not a crash.
def _unmigrated(error: Exception) -> bool:
    text = str(error)
    return "no such table" in text or "no such column" in text or (
        "does not exist" in text and ('relation "' in text or "column " in text)
    )


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    if len(sys.argv) > 1 and sys.argv[1] in OFFLINE_COMMANDS and not os.environ.get("SECRET_KEY"):
        os.environ["SECRET_KEY"] = secrets.token_urlsafe(50)
    from django.core.exceptions import ImproperlyConfigured
    from django.core.management import execute_from_command_line
    from django.db import DatabaseError

    try:
        execute_from_command_line(sys.argv)
    except ImproperlyConfigured as error:
        # A setting the operator must give (SECRET_KEY, a malformed URL): say which, not a traceback.
        sys.stderr.write(f"Configuration: {error}. The README's \"Configuration\" lists every setting.\n")
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
