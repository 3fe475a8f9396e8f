"""A member watches a batch's progress and cancels it, in Chromium (axe checks every page)."""

from __future__ import annotations

import pytest
from playwright.sync_api import Page, expect

from portal.batches.lifecycle import batch_validate
from portal.batches.models import Batch, BatchStatus
from portal.batches.services import batch_create, file_create
from tests.helpers import builders
from tests.helpers.batches import SIM_MODEL, empty_batch_queue, input_lines, jsonl
from tests.helpers.browser import login, shot

pytestmark = [
    pytest.mark.browser,
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("gateway_redis_db"),
]


def test_a_member_sees_progress_and_cancels_a_batch(page: Page, live_server, bob, team):
    empty_batch_queue()
    key = builders.api_key(team, models=[SIM_MODEL])[0]
    file = file_create(team=team, filename="in.jsonl", content=jsonl(input_lines(4)), purpose="batch")
    batch = batch_create(
        team=team,
        api_key=key,
        input_file_id=file.public_id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    batch_validate(batch_id=batch.pk)

    login(page, live_server, "bob", "bob-password", next_path=f"/teams/{team.slug}/")
    page.get_by_role("link", name="Batches").first.click()
    bar = page.get_by_role("progressbar", name="0 of 4 lines done")
    expect(bar).to_have_attribute("max", "4")
    shot(page, "batches-list")
    page.get_by_role("button", name=f"Cancel batch {batch.public_id}").click()
    expect(page.locator(".batch-status")).to_have_text("cancelling")
    expect(page.get_by_role("button", name=f"Cancel batch {batch.public_id}")).to_have_count(0)
    batch.refresh_from_db()
    assert batch.status == BatchStatus.CANCELLING
    assert Batch.objects.filter(team=team).count() == 1
