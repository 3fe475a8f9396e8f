"""PostgreSQL restarts under a running web process and worker; neither is restarted.

A private cluster (the shared one is never touched) holds the portal's schema; uvicorn (pages,
REST API, gateway) and a Celery `control` worker run against it with DATABASE_CONN_MAX_AGE=60
(the default). `pg_ctl restart -m fast` terminates every connection. The next page, API call,
gateway request that misses its cache, and task must each succeed at the first attempt.

What makes each one work: pages and the API run each request in a fresh thread under ASGI, so
a fresh connection; Celery's Django fixup closes connections before every task; the gateway's
loaders reuse one long-lived thread and its connection, and CONN_HEALTH_CHECKS tests that
connection before its first query after `close_old_connections` (without it, measured: the
first cache miss after the restart failed). While PostgreSQL is down, the gateway serves what
it has cached and answers 503 `database_unavailable` for what it has not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import psycopg
import pytest
from celery import Celery
from django.conf import settings

from devtools import stop, wait_until
from tests.helpers import ROOT

from .conftest import start_web

pytestmark = [pytest.mark.faults]

SEED = """
import json
from django.contrib.auth import get_user_model
from portal.deployments.models import Deployment, DeploymentProfile
from portal.inventory.services import node_create
from portal.registry.services import model_version_create
from portal.teams.models import Team
from portal.teams.services import api_key_create
from tests.helpers.samples import bundled_config

get_user_model().objects.create_user("alice", password="alice-password", is_staff=True)
team = Team.objects.create(name="Search", slug="search", gpu_quota=8)
node = node_create(name="local", hostname="127.0.0.1")
version = model_version_create(name="m-pg", config=bundled_config("llama-2-7b-chat-hf"))
profile = DeploymentProfile.objects.create(name="p-pg", model_version=version)
Deployment.objects.create(
    name="d-pg", team=team, model_version=version, profile=profile, node=node,
    desired_state="running", state="serving", endpoint_url="{upstream}",
)
keys = [api_key_create(team=team, name=f"k{{i}}", allowed_models=["m-pg"])[1] for i in range(3)]
print(json.dumps({{"keys": keys}}))
"""


def manage(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def attempt(what: str, call, results: dict) -> None:
    """Run `call`; on a failure record it and try once more a second later."""
    try:
        results[what] = ("first attempt", call())
    except Exception as error:  # recorded, then asserted on
        time.sleep(1)
        try:
            results[what] = (f"second attempt (first: {error!r:.120})", call())
        except Exception as again:
            results[what] = (f"failed twice: {again!r:.200}", None)


@pytest.mark.timeout(300)
def test_web_and_worker_reconnect_by_themselves_after_postgres_restarts(
    private_postgres, private_redis, fake_upstream, tmp_path
):
    with psycopg.connect(private_postgres.url("postgres"), autocommit=True) as admin:
        admin.execute("CREATE DATABASE portal")
    env = {
        "DATABASE_URL": private_postgres.url("portal"),
        "DATABASE_CONN_MAX_AGE": "60",
        "REDIS_URL": private_redis.url,  # broker, results and the gateway's state: private too
        # Longer than the whole test on a loaded machine: the first key must still be cached when
        # PostgreSQL is stopped below; the second is a real cache miss after the restart.
        "GATEWAY_CACHE_S": "3600",
    }
    began = time.monotonic()
    manage(env, "migrate", "--noinput")
    migrate_s = time.monotonic() - began
    keys = json.loads(manage(env, "shell", "-c", SEED.format(upstream=fake_upstream)).splitlines()[-1])[
        "keys"
    ]

    web = start_web(tmp_path / "web.log", env)
    worker_log = (tmp_path / "worker.log").open("wb")
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "portal", "worker", "-Q", "control", "-n", "faults-pg@%h",
         "--concurrency", "2", "--loglevel", "INFO"],
        cwd=ROOT,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", **env},
        stdout=worker_log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    # Not the current app: the portal's own app must keep its broker for the tests that follow.
    app = Celery("faults-client", broker=private_redis.url, backend=private_redis.url, set_as_current=False)
    # The worker's queues and results live under this installation's Redis namespace.
    app.conf.broker_transport_options = settings.CELERY_BROKER_TRANSPORT_OPTIONS
    app.conf.result_backend_transport_options = settings.CELERY_RESULT_BACKEND_TRANSPORT_OPTIONS
    session = httpx.Client(base_url=web.url, timeout=30)
    try:
        # Before: a signed-in session, a page, the API, the gateway and a task, each using the database.
        session.get("/accounts/login/")
        credentials = {"username": "alice", "password": "alice-password"}
        login = session.post(
            "/accounts/login/",
            data={**credentials, "csrfmiddlewaretoken": session.cookies["csrftoken"]},
            headers={"Referer": f"{web.url}/accounts/login/"},
        )
        assert login.status_code == 302, login.text[:500]

        def page() -> int:
            response = session.get("/nodes/")
            assert response.status_code == 200 and "local" in response.text, response.status_code
            return response.status_code

        def api() -> int:
            response = httpx.get(f"{web.url}/api/v1/nodes/", auth=("alice", "alice-password"), timeout=30)
            assert response.status_code == 200 and response.json()["results"][0]["name"] == "local"
            return response.status_code

        def gateway(key: str):
            def call() -> int:
                response = httpx.post(
                    f"{web.url}/v1/chat/completions",
                    headers={"Authorization": f"Bearer {key}"},
                    json={"model": "m-pg", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
                    timeout=30,
                )
                assert response.status_code == 200, response.text
                return response.status_code

            return call

        def task() -> int:
            # supervise_all reads deployments and nodes (and returns how many nodes it sent a pass to).
            return app.send_task("deployments.supervise_all", queue="control").get(timeout=30)

        def usage_rows() -> int:
            with psycopg.connect(private_postgres.url("portal")) as db:
                return db.execute("SELECT count(*) FROM teams_usage").fetchone()[0]

        def flush_task(expected: int):
            def call() -> int:
                # usage_flush (keeps no result) moves the gateway's records from Redis into PostgreSQL.
                app.send_task("portal.teams.tasks.usage_flush", queue="control")
                return wait_until(
                    lambda: (n := usage_rows()) >= expected and n, timeout_s=60, what=f"{expected} usage rows"
                )

            return call

        assert page() == 200 and api() == 200 and gateway(keys[0])() == 200
        assert task() == 1 and flush_task(1)() == 1

        restart_s = private_postgres.restart()

        results: dict[str, tuple[str, object]] = {}
        attempt("page", page, results)
        attempt("api", api, results)
        attempt("gateway, cached key", gateway(keys[0]), results)
        attempt("gateway, key never seen (cache miss)", gateway(keys[1]), results)
        attempt("task (reads)", task, results)
        attempt("task (writes)", flush_task(3), results)
        print(
            f"\nmigrate {migrate_s:.1f} s; pg_ctl restart -m fast {restart_s:.1f} s; after it:\n"
            + "\n".join(f"  {what}: {how}, got {value}" for what, (how, value) in results.items())
        )
        assert web.process.poll() is None and worker.poll() is None  # the same processes throughout
        assert {what: how for what, (how, _value) in results.items()} == dict.fromkeys(
            results, "first attempt"
        )
        assert results["task (writes)"][1] == 3  # the two gateway requests after the restart, written

        # While it is down (stopped, not restarting): the gateway goes on serving keys and routes it
        # has cached; one it has not seen is a clear 503 (OpenAI-shaped), not an HTML 500.
        private_postgres.ctl("-m", "fast", "stop")
        cached = gateway(keys[0])()
        unseen = httpx.post(
            f"{web.url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {keys[2]}"},
            json={"model": "m-pg", "messages": [{"role": "user", "content": "Hi"}]},
            timeout=30,
        )
        page_down = session.get("/nodes/").status_code
        private_postgres.start()
        print(f"while down: cached key {cached}, unseen key {unseen.status_code} {unseen.text[:100]}")
        print(f"while down: a page {page_down} (Django's error page)")
        assert unseen.status_code == 503 and unseen.json()["error"]["code"] == "database_unavailable"
        assert int(unseen.headers["retry-after"]) >= 1
        assert gateway(keys[2])() == 200 and page() == 200 and task() == 1  # back: first attempt again
    finally:
        session.close()
        app.close()
        stop(web.process)
        stop(worker)
        worker_log.close()
