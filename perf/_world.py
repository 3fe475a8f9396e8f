"""The throwaway world the perf scripts build: a private Redis, a SQLite portal, an adopted endpoint.

Each script (proxy_bench, priority_classes, soak) measures through the portal's real services and
processes without touching the machine's PostgreSQL or Redis: everything lives in a temporary
directory and dies with the script.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from devtools import free_port
from perf._common import spawn, wait_redis


def log_file(directory: Path, name: str):
    return open(directory / f"{name}.log", "wb")  # the child keeps it open until it exits


def start_private_redis(directory: Path, processes: list[subprocess.Popen]) -> str:
    """A redis-server of our own on a free port, up and answering; its URL (no database)."""
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is not installed: the benchmark runs its own private Redis")
    port = free_port()
    process = spawn(
        ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
         "--dir", str(directory)], stdout=log_file(directory, "redis"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    processes.append(process)
    wait_redis(port, process)
    return f"redis://127.0.0.1:{port}"


def use_throwaway_portal(directory: Path, redis_url: str, *, label: str, **extra: str) -> None:
    """Point this process, and every process it starts, at the world's database and Redis."""
    os.environ.update(
        {
            "DJANGO_SETTINGS_MODULE": "portal.settings",
            "DATABASE_URL": f"sqlite:///{directory / 'portal.sqlite3'}",
            "REDIS_URL": f"{redis_url}/0",
            "GATEWAY_REDIS_URL": f"{redis_url}/0",
            "CELERY_BROKER_URL": f"{redis_url}/1",
            "CELERY_RESULT_BACKEND": f"{redis_url}/1",
            # The adopted endpoint's first health check runs inline instead of waiting for a worker.
            "CELERY_TASK_ALWAYS_EAGER": "true",
            "PORTAL_RUN_DIR": str(directory / "run"),
            "SECRET_KEY": f"{label}-only-secret-key-0123456789abcdefghijklmnopqrstuvwxyz",
            "SECURE_SSL_REDIRECT": "false",
            "DEBUG": "false",
            "LOG_LEVEL": "WARNING",
            **extra,
        }
    )


def adopted_endpoint(*, upstream: str, model: str, config: str, name: str, team: dict[str, Any]):
    """Migrate; a team, the model and the upstream as its adopted endpoint, serving, through the
    portal's services as `register_endpoint` does. Returns (team, deployment)."""
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection

    call_command("migrate", verbosity=0)
    with connection.cursor() as cursor:
        cursor.execute("PRAGMA journal_mode=WAL")  # the flusher writes while the gateways read

    from inference.hf_config import known_configs
    from portal.deployments.services import endpoint_register
    from portal.registry.services import model_version_create
    from portal.teams.models import Team

    owner = Team.objects.create(**team)  # with quotas set at once, as the admin would
    version = model_version_create(name=model, config=json.loads(known_configs()[config].read_text()))
    deployment = endpoint_register(name=name, team=owner, model_version=version, url=f"{upstream}/v1")
    deployment.refresh_from_db()
    if deployment.state != "serving":
        raise SystemExit(f"the endpoint at {upstream} is {deployment.state}: {deployment.state_reason}")
    return owner, deployment
