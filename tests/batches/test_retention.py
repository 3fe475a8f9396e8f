"""Batch files are kept BATCH_FILE_RETENTION_DAYS, stored through default_storage, then pruned."""

from __future__ import annotations

import datetime as dt

import pytest
from django.core.files.storage import default_storage
from django.utils import timezone

from portal.batches.models import BatchFile
from portal.batches.services import batch_create, file_create
from portal.dashboard.services import retention_prune
from tests.helpers import builders
from tests.helpers.batches import input_lines, jsonl

pytestmark = [pytest.mark.django_db(transaction=True)]


def test_the_daily_prune_deletes_expired_files_but_keeps_a_running_batchs_input(team, settings, tmp_path):
    settings.MEDIA_ROOT = str(tmp_path)
    settings.BATCH_FILE_RETENTION_DAYS = 2
    key = builders.api_key(team)[0]
    old = file_create(team=team, filename="old.jsonl", content=b"{}\n", purpose="batch")
    used = file_create(team=team, filename="used.jsonl", content=jsonl(input_lines(1)), purpose="batch")
    batch_create(team=team, api_key=key, input_file_id=used.public_id, endpoint="/v1/chat/completions",
                 completion_window="24h")  # fmt: skip
    assert old.storage_name.startswith(f"batches/{team.pk}/") and default_storage.exists(old.storage_name)
    assert old.expires_at - timezone.now() > dt.timedelta(days=1)

    done = retention_prune(now=timezone.now() + dt.timedelta(days=3))

    assert done["batch_files"] == 1
    assert list(BatchFile.objects.values_list("public_id", flat=True)) == [used.public_id]
    assert not default_storage.exists(old.storage_name) and default_storage.exists(used.storage_name)
