"""Every numeric setting is bounded at start: a 0, negative, huge or non-finite value that would
turn a limit off (a lease of 0 let a cap of 1 run 3 streams) stops the process with one line
naming the setting (manage.py's "Configuration: ..." and exit status 2)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Each case: the environment it sets, and the setting its refusal must name.
REFUSED = [
    ({"GATEWAY_SLOT_LEASE_S": "0"}, "GATEWAY_SLOT_LEASE_S"),
    ({"GATEWAY_SLOT_LEASE_S": "-5"}, "GATEWAY_SLOT_LEASE_S"),
    ({"GATEWAY_SLOT_LEASE_S": "3", "GATEWAY_REDIS_TIMEOUT_S": "2"}, "GATEWAY_SLOT_LEASE_S"),
    ({"GATEWAY_FIRST_TOKEN_TIMEOUT_S": "0"}, "GATEWAY_FIRST_TOKEN_TIMEOUT_S"),
    ({"GATEWAY_FIRST_TOKEN_TIMEOUT_LONG_S": "-1"}, "GATEWAY_FIRST_TOKEN_TIMEOUT_LONG_S"),
    ({"GATEWAY_READ_TIMEOUT_S": "0"}, "GATEWAY_READ_TIMEOUT_S"),
    ({"GATEWAY_CONNECT_TIMEOUT_S": "inf"}, "GATEWAY_CONNECT_TIMEOUT_S"),
    ({"GATEWAY_QUEUE_TIMEOUT_S": "nan"}, "GATEWAY_QUEUE_TIMEOUT_S"),
    ({"GATEWAY_QUEUE_TIMEOUT_S": "0"}, "GATEWAY_QUEUE_TIMEOUT_S"),
    ({"GATEWAY_BATCH_QUEUE_TIMEOUT_S": "1e9"}, "GATEWAY_BATCH_QUEUE_TIMEOUT_S"),
    ({"GATEWAY_QUEUE_MAX": "0"}, "GATEWAY_QUEUE_MAX"),
    ({"GATEWAY_MAX_CONNECTIONS": "1000000000"}, "GATEWAY_MAX_CONNECTIONS"),
    ({"GATEWAY_MAX_BODY_BYTES": "-1"}, "GATEWAY_MAX_BODY_BYTES"),
    ({"GATEWAY_LONG_PROMPT_MAX_INFLIGHT": "0"}, "GATEWAY_LONG_PROMPT_MAX_INFLIGHT"),
    ({"GATEWAY_LONG_PROMPT_TOKENS": "0"}, "GATEWAY_LONG_PROMPT_TOKENS"),
    ({"GATEWAY_CACHE_S": "-1"}, "GATEWAY_CACHE_S"),
    ({"GATEWAY_REDIS_TIMEOUT_S": "0"}, "GATEWAY_REDIS_TIMEOUT_S"),
    ({"GATEWAY_MAX_PROMPTS": "5000"}, "GATEWAY_MAX_PROMPTS"),
    ({"DEPLOYMENT_SUPERVISE_INTERVAL_S": "0"}, "DEPLOYMENT_SUPERVISE_INTERVAL_S"),
    ({"DEPLOYMENT_LEASE_TTL_S": "-1"}, "DEPLOYMENT_LEASE_TTL_S"),
    ({"DEPLOYMENT_HEALTH_FAILURES": "0"}, "DEPLOYMENT_HEALTH_FAILURES"),
    ({"DEPLOYMENT_RESTART_BACKOFF_S": "-1"}, "DEPLOYMENT_RESTART_BACKOFF_S"),
    ({"DATABASE_CONN_MAX_AGE": "-1"}, "DATABASE_CONN_MAX_AGE"),
    ({"PORTAL_METRICS_FLUSH_S": "0"}, "PORTAL_METRICS_FLUSH_S"),
    ({"PORTAL_CONVERSION_LEASE_S": "0"}, "PORTAL_CONVERSION_LEASE_S"),
    ({"LOGIN_FAILURE_LIMIT": "15s"}, "LOGIN_FAILURE_LIMIT"),
    ({"RETENTION_AUDIT_DAYS": "-3"}, "RETENTION_AUDIT_DAYS"),
    ({"DATA_UPLOAD_MAX_MEMORY_SIZE": "0"}, "DATA_UPLOAD_MAX_MEMORY_SIZE"),
    ({"BENCHMARK_LEASE_S": "0"}, "BENCHMARK_LEASE_S"),
    ({"BENCHMARK_SWEEP_INTERVAL_S": "0"}, "BENCHMARK_SWEEP_INTERVAL_S"),
    ({"ADOPTED_ENDPOINT_ALLOWED_NETWORKS": "169.254.0.0/33"}, "ADOPTED_ENDPOINT_ALLOWED_NETWORKS"),
    ({"ADOPTED_ENDPOINT_ALLOWED_NETWORKS": "169.254.1.1/16"}, "ADOPTED_ENDPOINT_ALLOWED_NETWORKS"),
    ({"BATCH_FILE_MAX_BYTES": "0"}, "BATCH_FILE_MAX_BYTES"),
    ({"BATCH_FILE_MAX_BYTES": "99999999999"}, "BATCH_FILE_MAX_BYTES"),
    ({"BATCH_MAX_LINES": "2000000"}, "BATCH_MAX_LINES"),
    ({"BATCH_LINE_MAX_BYTES": "10"}, "BATCH_LINE_MAX_BYTES"),
    ({"BATCH_FILE_RETENTION_DAYS": "-1"}, "BATCH_FILE_RETENTION_DAYS"),
    ({"BATCH_CONCURRENCY": "0"}, "BATCH_CONCURRENCY"),
    ({"BATCH_RUNNER_LEASE_S": "0"}, "BATCH_RUNNER_LEASE_S"),
    ({"BATCH_DISPATCH_INTERVAL_S": "0"}, "BATCH_DISPATCH_INTERVAL_S"),
    ({"BATCH_RETRY_S": "nan"}, "BATCH_RETRY_S"),
    ({"BATCH_RUN_WINDOW": "8pm-7am"}, "BATCH_RUN_WINDOW"),
    ({"BATCH_RUN_WINDOW": "24:00-07:00"}, "BATCH_RUN_WINDOW"),
]

LOAD_EACH = """
import json, os, runpy, sys
from django.core.exceptions import ImproperlyConfigured
base = dict(os.environ)
out = []
for env in json.loads(sys.argv[1]):
    os.environ.clear(); os.environ.update(base); os.environ.update(env)
    try:
        runpy.run_path("portal/settings.py")
        out.append("")
    except ImproperlyConfigured as error:
        out.append(str(error))
print(json.dumps(out))
"""


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("GATEWAY_", "DEPLOYMENT_", "PORTAL_METRICS"))
    }
    env.update(SECRET_KEY="x" * 50, DATABASE_URL="sqlite:///:memory:", **extra)
    env.pop("DJANGO_SETTINGS_MODULE", None)
    return env


def test_it_refuses_every_numeric_setting_that_would_turn_a_limit_off_naming_it():
    cases = [env for env, _name in REFUSED] + [{}]  # the defaults load
    result = subprocess.run(
        [sys.executable, "-c", LOAD_EACH, json.dumps(cases)],
        cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    messages = json.loads(result.stdout)
    for (env, name), message in zip(REFUSED, messages, strict=False):
        assert message.startswith(f"{name}="), (env, message)
    assert messages[-1] == ""


def test_every_numeric_setting_is_read_through_a_bounded_reader():
    source = (ROOT / "portal" / "settings.py").read_text()
    assert not re.findall(r"env\.(int|float)\(", source)


@pytest.mark.parametrize("value", ["0", "-1"])
def test_manage_py_says_which_setting_in_one_line_and_exits_2(tmp_path, value):
    result = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=ROOT, env=clean_env(GATEWAY_SLOT_LEASE_S=value), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "GATEWAY_SLOT_LEASE_S" in result.stderr, result.stderr
