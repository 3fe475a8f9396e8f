"""The batch pages: a member's list and detail (progress, counts, why it waits, cancel, downloads),
staff's list with the pause switch, and the batch load on the ops dashboard. Another team's batch is
a 404 everywhere."""

from __future__ import annotations

import pytest

from portal.batches.lifecycle import batch_validate
from portal.batches.models import Batch, BatchStatus, WaitReason
from portal.batches.selectors import batches_paused
from portal.batches.services import batch_create, file_create
from tests.helpers import builders
from tests.helpers.batches import SIM_MODEL, empty_batch_queue, input_lines, jsonl

pytestmark = [pytest.mark.django_db(transaction=True)]


@pytest.fixture
def started(team, gw_redis):
    """A validated batch of 4 lines, in progress, that no runner has started."""
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
    batch.refresh_from_db()
    assert batch.status == BatchStatus.IN_PROGRESS
    return batch


def _urls(batch: Batch) -> list[str]:
    base = f"/teams/{batch.team.slug}/batches/{batch.public_id}/"
    return [f"/teams/{batch.team.slug}/batches/", base, base + "output.jsonl"]


def test_a_member_sees_the_progress_and_counts_of_the_team_batches(client, bob, started):
    client.force_login(bob)
    page = client.get(f"/teams/{started.team.slug}/batches/").content.decode()
    assert started.public_id in page
    assert f'<progress id="progress-{started.public_id}" max="4" value="0">' in page
    assert "0 of 4 lines done" in page
    assert f'aria-label="Cancel batch {started.public_id}"' in page
    detail = client.get(f"/teams/{started.team.slug}/batches/{started.public_id}/").content.decode()
    assert 'Pending</th><td class="num">4' in detail
    nav = client.get(f"/teams/{started.team.slug}/usage/").content.decode()
    assert f'href="/teams/{started.team.slug}/batches/"' in nav


def test_another_team_gets_404_for_every_batch_page(client, charlie, started):
    other = builders.team("Other", members=[charlie])
    client.force_login(charlie)
    assert client.get(f"/teams/{started.team.slug}/batches/").status_code == 404
    for url in _urls(started)[1:]:
        # Through charlie's own team the batch is not found either.
        assert client.get(url.replace(started.team.slug, other.slug)).status_code == 404
    cancel = f"/teams/{other.slug}/batches/{started.public_id}/cancel/"
    assert client.post(cancel).status_code == 404
    started.refresh_from_db()
    assert started.status == BatchStatus.IN_PROGRESS


def test_a_member_cancels_with_a_post_only(client, bob, started):
    client.force_login(bob)
    url = f"/teams/{started.team.slug}/batches/{started.public_id}/cancel/"
    assert client.get(url).status_code == 405
    response = client.post(url)
    assert response.status_code == 302
    started.refresh_from_db()
    assert started.status == BatchStatus.CANCELLING
    detail = client.get(response["Location"]).content.decode()
    assert "cancelling" in detail and "Cancel batch" not in detail


def test_the_page_says_why_a_batch_waits(client, bob, started):
    client.force_login(bob)
    Batch.objects.filter(pk=started.pk).update(wait_reason=WaitReason.DAILY_BUDGET)
    page = client.get(f"/teams/{started.team.slug}/batches/").content.decode()
    assert "the team&#x27;s daily token budget is spent: waits until tomorrow (UTC)" in page


def test_the_output_file_downloads_once_written(client, bob, started):
    client.force_login(bob)
    url = f"/teams/{started.team.slug}/batches/{started.public_id}/output.jsonl"
    assert client.get(url).status_code == 404
    out = file_create(
        team=started.team, filename="out.jsonl", content=b'{"custom_id": "req-0"}\n', purpose="batch_output"
    )
    Batch.objects.filter(pk=started.pk).update(output_file=out)
    response = client.get(url)
    assert response.status_code == 200 and response.content == b'{"custom_id": "req-0"}\n'
    assert "attachment" in response["Content-Disposition"]


def test_staff_pause_and_resume_all_batch_work_and_members_see_it(client, alice, bob, started):
    client.force_login(bob)
    assert client.post("/batches/", {"action": "pause"}).status_code == 302  # to the admin login
    assert not batches_paused()
    client.force_login(alice)
    page = client.get("/batches/").content.decode()
    assert started.public_id in page and started.team.name in page
    client.post("/batches/", {"action": "pause"})
    assert batches_paused()
    assert "Resume all batch work" in client.get("/batches/").content.decode()
    client.force_login(bob)
    assert (
        "staff paused all batch work" in client.get(f"/teams/{started.team.slug}/batches/").content.decode()
    )
    client.force_login(alice)
    client.post("/batches/", {"action": "resume"})
    assert not batches_paused()


def test_the_ops_dashboard_shows_the_batch_load_per_model(client, alice, started):
    client.force_login(alice)
    page = client.get("/").content.decode()
    assert 'id="batch-load"' in page
    assert f"<td>{SIM_MODEL}</td>" in page
    assert '<td class="num">0</td><td class="num">4</td>' in page
