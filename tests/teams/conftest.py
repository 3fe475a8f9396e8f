"""Fixtures of the usage tests: the gateway's Redis (this run's database, emptied) and a key."""

from __future__ import annotations

import os

import pytest
import redis

from portal.core.redis.client import redis_keys
from portal.teams.services import api_key_create


def _clear(client: redis.Redis) -> None:
    stale = [*client.scan_iter(f"{redis_keys().gateway}*"), *client.scan_iter(f"{redis_keys().metrics}*")]
    if stale:
        client.delete(*stale)


@pytest.fixture
def gw(settings):
    settings.GATEWAY_REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/15")
    client = redis.Redis.from_url(settings.GATEWAY_REDIS_URL)
    _clear(client)
    yield client
    _clear(client)
    client.close()


@pytest.fixture
def key(team):
    return api_key_create(team=team)[0]


@pytest.fixture
def models_m1_m2(db):
    """Registered models "m1" and "m2": a key's model list must name registered models."""
    from portal.registry.services import model_version_create
    from tests.helpers.samples import bundled_config

    return [model_version_create(name=n, config=bundled_config("llama-2-7b-chat-hf")) for n in ("m1", "m2")]
