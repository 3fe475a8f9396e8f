"""A fresh clone: no SECRET_KEY, no migrated database. Pure calculations still run; the rest say
what to do instead of showing a traceback. Each test runs `manage.py` as a new user would."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Each test starts manage.py on a fresh SQLite file (migrations included): out of make test-fast.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "inference" / "data" / "hf_configs" / "llama-2-7b-chat-hf" / "config.json"


def manage(tmp_path: Path, *args: str, **extra_env: str) -> subprocess.CompletedProcess:
    """`manage.py` with an empty SQLite file for a database and neither SECRET_KEY nor DEBUG."""
    env = {key: value for key, value in os.environ.items() if key not in ("SECRET_KEY", "DEBUG")}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    env["DATABASE_URL"] = f"sqlite:///{tmp_path / 'fresh.sqlite3'}"
    env["PORTAL_ENV_FILE"] = str(tmp_path / "no-make-run.env")  # not this checkout's var/.env
    env.update(extra_env)
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


PLAN = ("--gpu", "v100-sxm2-32gb", "--gpus", "1")


@pytest.mark.parametrize("model", [str(CONFIG), "llama-2-7b-chat-hf"])
def test_it_plans_a_config_path_or_bundled_config_without_a_secret_or_a_database(tmp_path, model):
    result = manage(tmp_path, "plan", *PLAN, "--model", model)
    assert result.returncode == 0, result.stderr
    assert "verdict: OK" in result.stdout


def test_it_simulates_a_config_path_without_a_secret_or_a_database(tmp_path):
    args = ("--model", str(CONFIG), "--enforce-eager", "--concurrency", "2", "--requests-per-level", "4")
    result = manage(tmp_path, "simulate", *PLAN, *args)
    assert result.returncode == 0, result.stderr
    assert "SLA operating point" in result.stdout


def test_it_runs_bench_against_a_url_without_a_secret_or_a_database(tmp_path):
    # Nothing listens on port 9: the command gets as far as the server and reports it, not the settings.
    args = ("--url", "http://127.0.0.1:9/v1", "--model", "m", "--concurrency", "1")
    args += ("--requests-per-level", "1")
    result = manage(tmp_path, "bench", *args)
    assert "SECRET_KEY" not in result.stderr
    assert "Traceback" not in result.stderr


def test_it_says_to_migrate_when_a_registered_model_cannot_be_read(tmp_path):
    result = manage(tmp_path, "plan", *PLAN, "--model", "my-model")
    assert result.returncode == 1
    assert "run `python manage.py migrate` first" in result.stderr
    assert "Traceback" not in result.stderr


def test_it_says_to_migrate_when_a_command_needs_the_database(tmp_path):
    result = manage(tmp_path, "create_key", "--team", "search", SECRET_KEY="a-test-secret")
    assert result.returncode == 1
    assert "run `python manage.py migrate` first" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("command", [("check",), ("create_key", "--team", "search"), ("migrate",)])
def test_a_command_that_signs_or_stores_says_a_secret_is_missing_without_a_traceback(tmp_path, command):
    result = manage(tmp_path, *command)
    assert result.returncode == 2
    assert "SECRET_KEY must be set" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_readmes_register_model_works_as_written_beside_make_run(tmp_path):
    # What `make run` writes before it starts (Makefile `run-env`); then the docs' command, in a
    # shell with neither SECRET_KEY nor DEBUG.
    env_file = tmp_path / "run.env"
    shell = {key: value for key, value in os.environ.items() if key not in ("SECRET_KEY", "DEBUG")}
    make = ["make", "--no-print-directory", "run-env", f"RUN_ENV={env_file}"]
    subprocess.run(make, cwd=ROOT, env=shell, check=True, capture_output=True)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(CONFIG.read_text())
    assert manage(tmp_path, "migrate", PORTAL_ENV_FILE=str(env_file)).returncode == 0
    args = ("--name", "llama-2-7b-chat-hf", "--path", str(model))
    result = manage(tmp_path, "register_model", *args, PORTAL_ENV_FILE=str(env_file))
    assert result.returncode == 0, result.stderr
    assert "SECRET_KEY" not in result.stderr
