"""The beat schedule names tasks that exist; the tasks call the services."""

from __future__ import annotations

import os

import pytest
from django.conf import settings

from portal.celery import app


def test_the_beat_schedule_names_registered_tasks():
    app.loader.import_default_modules()
    for name in ("gateway-usage-flush", "gateway-usage-rollup", "gateway-usage-partitions"):
        assert settings.CELERY_BEAT_SCHEDULE[name]["task"] in app.tasks


@pytest.mark.django_db(transaction=True)
def test_the_rollup_task_flushes_and_rolls_up(team, settings):
    from portal.teams.tasks import usage_rollup

    settings.GATEWAY_REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/15")
    assert usage_rollup() == []
