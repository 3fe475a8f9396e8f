"""Production settings pass Django's deployment checks; a bad environment fails loudly."""

import json
import os
import subprocess
import sys
from pathlib import Path

from portal.core.redis.keys import namespace_for_database
from tests.helpers.manage import PRODUCTION, manage, settings_refusals, settings_values

ROOT = Path(__file__).resolve().parents[2]


def test_it_passes_check_deploy_with_production_settings():
    result = manage("check", "--deploy", "--fail-level", "WARNING", env=PRODUCTION)
    assert result.returncode == 0, result.stdout + result.stderr


def test_it_refuses_to_start_without_a_secret_key_when_debug_is_off():
    result = manage("check", env={**PRODUCTION, "SECRET_KEY": ""})
    assert result.returncode != 0
    assert "SECRET_KEY must be set" in result.stderr


def test_it_fails_loudly_on_a_malformed_boolean():
    result = manage("check", env={**PRODUCTION, "DEBUG": "perhaps"})
    assert result.returncode != 0


def test_check_deploy_reports_no_issue_and_silences_none():
    result = manage("check", "--deploy", "--fail-level", "WARNING", env=PRODUCTION)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "System check identified no issues (0 silenced)." in result.stdout
    assert "WARNING" not in result.stderr


def test_production_settings_bound_bodies_and_guard_input():
    code = (
        "import json; from django.conf import settings as s; print(json.dumps({"
        "'debug': s.DEBUG, 'data_upload': s.DATA_UPLOAD_MAX_MEMORY_SIZE,"
        "'gateway_body': s.GATEWAY_MAX_BODY_BYTES,"
        "'middleware': s.MIDDLEWARE, 'hsts': s.SECURE_HSTS_SECONDS, 'ssl_redirect': s.SECURE_SSL_REDIRECT,"
        "'cookies_secure': [s.SESSION_COOKIE_SECURE, s.CSRF_COOKIE_SECURE]}))"
    )
    result = manage("shell", "--no-imports", "-c", code, env=PRODUCTION)
    assert result.returncode == 0, result.stderr
    values = json.loads(result.stdout)
    assert values["debug"] is False
    # Pages and the API read at most 2.5 MiB of body, the gateway 1 MiB (portal/asgi.py refuses more).
    assert values["data_upload"] == 2_621_440 and values["gateway_body"] == 1024 * 1024
    assert "portal.core.middleware.RejectUnstorableTextMiddleware" in values["middleware"]
    assert "portal.audit.middleware.AuditContextMiddleware" in values["middleware"]
    assert values["hsts"] >= 31536000 and values["ssl_redirect"] is True
    assert values["cookies_secure"] == [True, True]


def _redis_settings(**env: str) -> dict:
    code = (
        "import json; from django.conf import settings as s; print(json.dumps({"
        "'namespace': s.PORTAL_REDIS_NAMESPACE,"
        "'broker_prefix': s.CELERY_BROKER_TRANSPORT_OPTIONS['global_keyprefix'],"
        "'results_prefix': s.CELERY_RESULT_BACKEND_TRANSPORT_OPTIONS['global_keyprefix']}))"
    )
    # An empty PORTAL_REDIS_NAMESPACE is unset (the test run's own is replaced).
    environment = {**PRODUCTION, "PORTAL_REDIS_NAMESPACE": "", **env}
    result = manage("shell", "--no-imports", "-c", code, env=environment)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_each_database_gets_its_own_redis_namespace_by_default():
    engine = "django.db.backends.postgresql"
    database = {"ENGINE": engine, "HOST": "db-a.internal", "PORT": 5432, "NAME": "portal"}
    a = _redis_settings(DATABASE_URL="postgres://portal@db-a.internal:5432/portal")
    b = _redis_settings(DATABASE_URL="postgres://portal@db-b.internal:5432/portal")
    assert a["namespace"] == namespace_for_database(database) != b["namespace"]  # the same in every process
    assert a["namespace"].startswith("portal-")
    assert a["broker_prefix"] == a["results_prefix"] == f"{a['namespace']}:celery:"


def test_it_refuses_a_malformed_redis_namespace():
    result = manage("check", env={**PRODUCTION, "PORTAL_REDIS_NAMESPACE": "two words"})
    assert result.returncode != 0
    assert "PORTAL_REDIS_NAMESPACE" in result.stderr


def test_it_refuses_gpu_health_settings_out_of_their_bounds():
    bad = [
        ("GPU_HEALTH_SAMPLE_INTERVAL_S", "1"),
        ("GPU_HEALTH_COMMAND_TIMEOUT_S", "500"),
        ("GPU_HEALTH_COMMAND_TIMEOUT_S", "40"),  # two calls would not fit in the 60 s interval
        ("GPU_HEALTH_THROTTLE_MINUTES", "0"),
        ("GPU_HEALTH_TEMPERATURE_WARNING_C", "hot"),
        ("GPU_HEALTH_XID_WINDOW_MINUTES", "99999"),
        ("RETENTION_GPU_SAMPLES_DAYS", "-1"),
    ]
    refusals = settings_refusals(*({name: value} for name, value in bad))
    for (name, value), refusal in zip(bad, refusals, strict=True):
        assert name in refusal, (name, value, refusal)


def test_it_refuses_gateway_limits_out_of_their_bounds():
    bad = [
        ("GATEWAY_MAX_PROMPTS", "0"),
        ("GATEWAY_MAX_PROMPTS", "5000"),
        ("GATEWAY_AUTH_FAILURES_PER_MINUTE", "0"),
        ("GATEWAY_MAX_PROMPTS", "many"),
    ]
    refusals = settings_refusals(*({name: value} for name, value in bad))
    for (name, value), refusal in zip(bad, refusals, strict=True):
        assert name in refusal or "invalid literal" in refusal, (name, value, refusal)


def test_it_refuses_engine_log_limits_out_of_bounds():
    bad = [("ENGINE_LOG_MAX_BYTES", "100"), ("ENGINE_LOG_KEEP", "-1"), ("ENGINE_LOG_KEEP", "lots")]
    refusals = settings_refusals(*({name: value} for name, value in bad))
    for (name, value), refusal in zip(bad, refusals, strict=True):
        assert name in refusal or "invalid literal" in refusal, (name, value, refusal)


def test_it_refuses_a_benchmark_gateway_url_that_is_not_an_http_url():
    bad = ["127.0.0.1:8000", "ftp://gateway", "http://"]
    refusals = settings_refusals(*({"BENCHMARK_GATEWAY_URL": value} for value in bad))
    for value, refusal in zip(bad, refusals, strict=True):
        assert "BENCHMARK_GATEWAY_URL" in refusal, (value, refusal)


def test_it_sends_members_benchmarks_to_the_port_the_portal_serves_when_no_gateway_url_is_set():
    derived, wildcard = settings_values(
        ["BENCHMARK_GATEWAY_URL"],
        {"PORTAL_PORT": "8100"},
        {"PORTAL_PORT": "8200", "PORTAL_HOST": "0.0.0.0"},  # noqa: S104
    )
    assert derived["BENCHMARK_GATEWAY_URL"] == "http://127.0.0.1:8100"
    assert wildcard["BENCHMARK_GATEWAY_URL"] == "http://127.0.0.1:8200"


def test_it_warns_when_the_benchmark_gateway_url_is_this_machine_on_another_port_than_the_portal():
    env = {**PRODUCTION, "PORTAL_PORT": "8100", "BENCHMARK_GATEWAY_URL": "http://127.0.0.1:8000"}
    result = manage("check", env=env)
    assert "portal.W001" in result.stdout + result.stderr
    assert "PORTAL_PORT=8100" in result.stdout + result.stderr


def test_it_refuses_a_trusted_proxy_count_out_of_bounds():
    refusals = settings_refusals({"TRUSTED_PROXY_COUNT": "-1"}, {"TRUSTED_PROXY_COUNT": "6"})
    assert all("TRUSTED_PROXY_COUNT" in refusal for refusal in refusals), refusals


def test_check_deploy_fails_when_the_redis_namespace_is_derived():
    result = manage("check", "--deploy", env={**PRODUCTION, "PORTAL_REDIS_NAMESPACE": ""})
    assert result.returncode != 0
    assert "portal.E001" in result.stderr and "PORTAL_REDIS_NAMESPACE is not set" in result.stderr


def test_the_derived_namespace_does_not_depend_on_how_the_database_url_is_spelled():
    spellings = [
        "postgres://portal@db:5432/portal", "postgres://portal@db/portal", "postgresql://portal@DB/portal",
    ]  # fmt: skip
    namespaces = {_redis_settings(DATABASE_URL=url)["namespace"] for url in spellings}
    assert len(namespaces) == 1
    assert namespaces != {_redis_settings(DATABASE_URL="postgres://portal@db:5433/portal")["namespace"]}


def test_it_gives_sqlite_wal_and_waiting_writers_for_several_processes(tmp_path):
    # A one-node installation (scripts/gpu_node.py, `make run`) writes one SQLite file from the web
    # process, the workers, the agent and beat at once: readers beside a writer (WAL), and a writer
    # that takes its lock when the transaction starts and waits for it instead of failing at once.
    env = {**PRODUCTION, "DATABASE_URL": f"sqlite:///{tmp_path / 'portal.sqlite3'}"}
    code = (
        "import json; from django.db import connection; connection.ensure_connection();"
        "c = connection.cursor(); c.execute('PRAGMA journal_mode'); mode = c.fetchone()[0];"
        "o = connection.settings_dict['OPTIONS'];"
        "print(json.dumps({'mode': mode, 'timeout': o.get('timeout'), 'tx': o.get('transaction_mode')}))"
    )
    result = manage("shell", "-c", code, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found == {"mode": "wal", "timeout": 20, "tx": "IMMEDIATE"}


def test_it_starts_on_sqlite_without_the_postgresql_driver(tmp_path):
    # A one-node installation on SQLite carries no psycopg: the gateway's usage store must import without it.
    env = {**PRODUCTION, "DATABASE_URL": f"sqlite:///{tmp_path / 'portal.sqlite3'}"}
    code = (
        "import sys; sys.modules['psycopg'] = None;"  # `import psycopg` raises ImportError from here on
        "import django; django.setup();"
        "import portal.urls, portal.teams.services.usage_queue as s;"
        "print(sorted(e.__name__ for e in s._REFUSED_ERRORS))"
    )
    clean = {k: v for k, v in os.environ.items() if k not in PRODUCTION and not k.startswith("SECURE_")}
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "IntegrityError" in result.stdout
