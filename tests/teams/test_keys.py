"""API keys: creation (shown once), storage (prefix + HMAC only), checks, revocation, the command."""

from __future__ import annotations

import datetime as dt
import io
import json
import os
import uuid

import pytest
import redis
from django.core.management import CommandError, call_command
from django.utils import timezone

from portal.core.errors import ApplicationError
from portal.core.redis.client import redis_keys
from portal.teams.models import ApiKey
from portal.teams.services import (
    api_key_create,
    api_key_digest,
    api_key_matches,
    api_key_prefix,
    api_key_revoke,
)

pytestmark = pytest.mark.django_db


def test_it_stores_only_the_prefix_and_an_hmac_of_the_key(team):
    key, token = api_key_create(team=team, allowed_models=["m1"])
    prefix, secret = token.removeprefix("sk-").split(".", 1)
    assert key.prefix == prefix
    assert key.digest == api_key_digest(token) != token
    assert len(key.digest) == 64
    assert secret not in json.dumps(list(ApiKey.objects.values()), default=str)


def test_it_checks_a_key_against_its_digest(team):
    key, token = api_key_create(team=team)
    assert api_key_matches(token, key.digest)
    assert not api_key_matches(token[:-1] + ("A" if token[-1] != "A" else "B"), key.digest)


def test_it_uses_its_own_hmac_secret_when_one_is_set(team, settings):
    key, token = api_key_create(team=team)
    settings.GATEWAY_KEY_HMAC_SECRET = "another-secret"
    assert not api_key_matches(token, key.digest)


@pytest.mark.parametrize("token", ["", "sk-", "sk-abc", "Bearer x", "sk-" + "a" * 20 + ".x", "x" * 300])
def test_it_finds_no_prefix_in_a_malformed_key(token):
    assert api_key_prefix(token) is None


def test_it_refuses_models_outside_the_teams_list(team):
    team.allowed_models = ["m1"]
    team.save()
    with pytest.raises(ApplicationError) as error:
        api_key_create(team=team, allowed_models=["m1", "m2"])
    assert error.value.field == "allowed_models"


def test_it_refuses_a_past_expiry_and_non_positive_limits(team):
    with pytest.raises(ApplicationError):
        api_key_create(team=team, expires_at=timezone.now() - dt.timedelta(days=1))
    with pytest.raises(ApplicationError) as error:
        api_key_create(team=team, rpm_limit=0)
    assert error.value.field == "rpm_limit"


@pytest.mark.parametrize(
    ("field", "value"), [("rpm_limit", 2**31), ("max_concurrent", 10**12), ("tokens_per_day", 2**63)]
)
def test_it_refuses_a_limit_larger_than_its_column(team, field, value):
    with pytest.raises(ApplicationError) as error:
        api_key_create(team=team, **{field: value})
    assert error.value.field == field
    assert not ApiKey.objects.filter(team=team).exists()


@pytest.mark.django_db(transaction=True)
def test_revoking_blocks_the_key_in_redis_at_once(team, settings):
    settings.GATEWAY_REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/15")
    key, _token = api_key_create(team=team)
    assert api_key_revoke(api_key=key) is True
    assert api_key_revoke(api_key=key) is False  # a second revoke is a no-op
    client = redis.Redis.from_url(settings.GATEWAY_REDIS_URL)
    assert client.get(redis_keys().blocked("key", key.pk)) == b"revoked"
    key.refresh_from_db()
    assert key.revoked_at is not None and not key.is_active


def test_create_key_prints_the_key_once(team):
    out, err = io.StringIO(), io.StringIO()
    call_command("create_key", "--team", "search", "--models", "m1,m2", "--rpm", "60", "--tpm", "1000",
                 "--tokens-per-day", "100000", "--max-concurrent", "4", stdout=out, stderr=err)  # fmt: skip
    token = out.getvalue().strip()
    key = ApiKey.objects.get(team=team)
    assert token.startswith(f"sk-{key.prefix}.")
    assert api_key_matches(token, key.digest)
    assert (key.allowed_models, key.rpm_limit, key.tpm_limit, key.tokens_per_day, key.max_concurrent) == (
        ["m1", "m2"], 60, 1000, 100000, 4,
    )  # fmt: skip
    assert token not in err.getvalue()


def test_create_key_refuses_an_unknown_team(db):
    with pytest.raises(CommandError, match="--team"):
        call_command("create_key", "--team", f"nope-{uuid.uuid4().hex[:4]}", stdout=io.StringIO())


def test_create_key_refuses_a_zero_limit(team):
    with pytest.raises(CommandError):
        call_command(
            "create_key", "--team", "search", "--rpm", "0", stdout=io.StringIO(), stderr=io.StringIO()
        )
