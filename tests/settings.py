"""Test settings: the production module with the environment a test run needs.

The suite talks to the real PostgreSQL (DATABASE_URL; pytest-django creates
`test_<name>`) and the real Redis. Security settings stay as in production
except the HTTPS redirect, which the test client and live server do not speak.
"""

import os

os.environ.setdefault("SECRET_KEY", "test-only-secret-key-not-for-production-use-0123456789")
os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/portal")
os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/15")
os.environ.setdefault("SECURE_SSL_REDIRECT", "false")
os.environ.setdefault("SESSION_COOKIE_SECURE", "false")
os.environ.setdefault("CSRF_COOKIE_SECURE", "false")
# Pinned in the environment, so every process a test starts (uvicorn, Celery workers) shares the
# test's keys and queues: derived from the database, it would differ, as pytest-django renames it.
os.environ.setdefault("PORTAL_REDIS_NAMESPACE", "test")
# Under pytest-xdist (`make test-fast`) each worker gets its own namespace: workers share one
# Redis database, and a test that empties its keys must not empty another worker's.
# Processes a worker starts inherit both variables and must keep the worker's namespace as it is.
_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
if _worker and not os.environ["PORTAL_REDIS_NAMESPACE"].endswith(_worker):
    os.environ["PORTAL_REDIS_NAMESPACE"] = f"{os.environ['PORTAL_REDIS_NAMESPACE']}-{_worker}"

from portal.settings import *  # noqa: E402, F403

# No collectstatic manifest in tests: serve static files straight from the apps.
STORAGES["staticfiles"] = {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"}  # noqa: F405
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # fast logins; never in production

# No collectstatic in tests: servestatic finds files in the apps as they are.
SERVESTATIC_USE_FINDERS = True
SERVESTATIC_AUTOREFRESH = True
