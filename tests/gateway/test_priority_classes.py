"""Priority classes through the real gateway: a batch key takes only a deployment's spare share
(GATEWAY_BATCH_SHARE, 0.5 here), waits in its own queue on its own deadline, and never ahead of an
interactive request; its usage records say batch."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from devtools import wait_until
from portal.core.redis.client import redis_keys
from tests.helpers.gateway import (
    BATCH_QUEUE_TIMEOUT_S,
    OUTLASTS_THE_BATCH_QUEUE,
    QUEUE_TIMEOUT_S,
    chat_body,
    slots_in_use,
    wait_for_slots_free,
)
from tests.helpers.processes import run_async

pytestmark = [pytest.mark.django_db(transaction=True)]


def batch_headers(setup) -> dict[str, str]:
    """A second key of the same team, in the batch class."""
    from portal.teams.services import api_key_create

    _key, token = api_key_create(
        team=setup.team, name="offline", allowed_models=[setup.model], priority_class="batch"
    )
    return {"Authorization": f"Bearer {token}"}


def queued(client, setup, *, batch: bool) -> int:
    keys = redis_keys()
    return client.zcard(keys.batch_queue(setup.model) if batch else keys.queue(setup.model))


def test_a_batch_key_gets_only_the_spare_share_while_an_interactive_one_gets_the_rest(
    gateway, serving, gw_redis
):
    serving.deployment.concurrency_cap = 2  # batch share 0.5: one slot for batch
    serving.deployment.save()
    batch = batch_headers(serving)
    url = f"{gateway.url}/v1/chat/completions"
    hold = chat_body(serving.model, "FAKE chunks=60 interval=50", stream=True)  # ~3 s

    async def go():
        async with httpx.AsyncClient(timeout=30) as client:
            first = asyncio.create_task(client.post(url, headers=batch, json=hold))
            await asyncio.to_thread(
                wait_until, lambda: slots_in_use(gw_redis, serving)["deployment"] == 1, what="batch in flight"
            )
            second = asyncio.create_task(client.post(url, headers=batch, json=chat_body(serving.model)))
            await asyncio.to_thread(
                wait_until, lambda: queued(gw_redis, serving, batch=True) == 1, what="the second batch queued"
            )
            interactive = await client.post(url, headers=serving.headers, json=chat_body(serving.model))
            # The interactive one came and went; the batch one still waits for the share.
            still_queued = queued(gw_redis, serving, batch=True)
            return interactive, still_queued, await first, await second

    interactive, still_queued, first, second = run_async(go())
    assert interactive.status_code == 200
    assert still_queued == 1
    assert (first.status_code, second.status_code) == (200, 200)
    assert not any(wait_for_slots_free(gw_redis, serving).values())


def test_a_waiting_interactive_request_gets_the_freed_slot_before_an_earlier_queued_batch_one(
    gateway, serving, gw_redis
):
    serving.deployment.concurrency_cap = 1  # batch share 0.5 of 1: an idle replica still serves batch
    serving.deployment.save()
    batch = batch_headers(serving)
    url = f"{gateway.url}/v1/chat/completions"
    second_long = chat_body(serving.model, "FAKE chunks=20 interval=50", stream=True)  # ~1 s each
    done: dict[str, float] = {}

    async def timed(client, name: str, headers: dict, body: dict) -> httpx.Response:
        response = await client.post(url, headers=headers, json=body)
        done[name] = time.monotonic()
        return response

    async def go():
        async with httpx.AsyncClient(timeout=30) as client:
            first_long = chat_body(serving.model, "FAKE chunks=50 interval=50", stream=True)  # ~2.5 s
            holder = asyncio.create_task(timed(client, "holder", serving.headers, first_long))
            await asyncio.to_thread(
                wait_until, lambda: slots_in_use(gw_redis, serving)["deployment"] == 1, what="the slot taken"
            )
            waiting_batch = asyncio.create_task(timed(client, "batch", batch, second_long))
            await asyncio.to_thread(
                wait_until, lambda: queued(gw_redis, serving, batch=True) == 1, what="the batch one queued"
            )
            waiting_interactive = asyncio.create_task(
                timed(client, "interactive", serving.headers, second_long)
            )
            await asyncio.to_thread(
                wait_until, lambda: queued(gw_redis, serving, batch=False) == 1, what="interactive queued"
            )
            return await asyncio.gather(holder, waiting_batch, waiting_interactive)

    responses = run_async(go())
    assert [r.status_code for r in responses] == [200, 200, 200]
    # One slot: whoever got it after the holder ran to its end before the other started.
    assert done["holder"] < done["interactive"] < done["batch"]


@pytest.mark.slow  # waits out a real timeout or a simulated acceptance
def test_a_batch_request_times_out_on_its_own_longer_deadline(gateway, serving, gw_redis):
    serving.deployment.concurrency_cap = 1
    serving.deployment.save()
    batch = batch_headers(serving)
    url = f"{gateway.url}/v1/chat/completions"

    async def go():
        async with httpx.AsyncClient(timeout=30) as client:
            hold = chat_body(serving.model, OUTLASTS_THE_BATCH_QUEUE, stream=True)
            holder = asyncio.create_task(client.post(url, headers=serving.headers, json=hold))
            await asyncio.to_thread(
                wait_until, lambda: slots_in_use(gw_redis, serving)["deployment"] == 1, what="the slot taken"
            )
            started = time.monotonic()
            refused = await client.post(url, headers=batch, json=chat_body(serving.model))
            return refused, time.monotonic() - started, await holder

    refused, waited, holder = run_async(go())
    assert holder.status_code == 200
    assert refused.status_code == 503
    error = refused.json()["error"]
    assert error["code"] == "batch_queue_timeout"
    assert "batch" in error["message"]
    assert refused.headers["retry-after"]
    # Past the interactive deadline: it waited on the batch one.
    assert waited >= BATCH_QUEUE_TIMEOUT_S > QUEUE_TIMEOUT_S
    assert queued(gw_redis, serving, batch=True) == 0


def test_usage_records_carry_the_callers_class(gateway, serving, gw_redis):
    from portal.teams.models import Usage
    from portal.teams.services import usage_flush

    batch = batch_headers(serving)
    url = f"{gateway.url}/v1/chat/completions"
    for headers in (serving.headers, batch):
        assert httpx.post(url, headers=headers, json=chat_body(serving.model), timeout=30).status_code == 200
    usage_flush()
    rows = Usage.objects.filter(team=serving.team).select_related("api_key")
    assert sorted((r.api_key.name, r.priority_class) for r in rows) == [
        ("offline", "batch"),
        ("tests", "interactive"),
    ]


def test_it_admits_a_members_interactive_key_as_batch_once_staff_demote_the_team(
    gateway, serving, gw_redis, alice, bob
):
    """A member's class never lifts a key above its team's: made interactive while the team was,
    the key follows the team down to batch. A class staff gave a key holds."""
    from django.test import Client

    from portal.teams.models import Usage
    from portal.teams.services import api_key_create, usage_flush

    team = serving.team
    models = [serving.model]
    _, member_token = api_key_create(
        team=team, name="member", allowed_models=models, created_by=bob, priority_class="interactive"
    )
    _, staff_token = api_key_create(
        team=team, name="staff", allowed_models=models, created_by=alice, priority_class="interactive"
    )
    staff = Client()
    staff.force_login(alice)
    demoted = staff.patch(
        f"/api/v1/teams/{team.slug}/", {"priority_class": "batch"}, content_type="application/json"
    )
    assert demoted.status_code == 200, demoted.content
    url = f"{gateway.url}/v1/chat/completions"
    for token in (member_token, staff_token):
        response = httpx.post(
            url, headers={"Authorization": f"Bearer {token}"}, json=chat_body(serving.model), timeout=30
        )
        assert response.status_code == 200, response.text
    usage_flush()
    classes = dict(Usage.objects.filter(team=team).values_list("api_key__name", "priority_class"))
    assert classes == {"member": "batch", "staff": "interactive"}
