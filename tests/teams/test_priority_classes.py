"""Priority classes on the team side: who may set a key's class, the keys page, the usage page and
the API split by class, the usage flush storing the class."""

from __future__ import annotations

import datetime as dt
import json
import uuid

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from portal.core.errors import ApplicationError
from portal.core.redis.client import redis_keys
from portal.teams.models import ApiKey, Usage, UsageDaily
from portal.teams.services import api_key_create, usage_flush
from tests.helpers.usage import record

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("gateway_redis_db")]


def logged_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_a_member_creates_a_batch_key_on_the_keys_page(bob, team):
    client = logged_in(bob)
    response = client.post(
        reverse("teams:keys", args=["search"]), {"name": "nightly", "priority_class": "batch"}
    )
    assert response.status_code == 200
    assert ApiKey.objects.get(team=team).priority_class == "batch"
    page = client.get(reverse("teams:keys", args=["search"])).content.decode()
    assert '<td class="priority-class">batch</td>' in page


def test_a_key_left_blank_follows_the_teams_class(bob, team):
    key, _ = api_key_create(team=team, created_by=bob)
    assert key.priority_class == ""
    page = logged_in(bob).get(reverse("teams:keys", args=["search"])).content.decode()
    assert 'interactive <span class="muted">(team\'s)</span>' in page


def test_only_staff_may_make_a_batch_teams_key_interactive(alice, bob, team):
    team.priority_class = "batch"
    team.save()
    with pytest.raises(ApplicationError) as refused:
        api_key_create(team=team, created_by=bob, priority_class="interactive")
    assert refused.value.field == "priority_class"
    response = logged_in(bob).post(reverse("teams:keys", args=["search"]), {"priority_class": "interactive"})
    assert response.status_code == 400 and not ApiKey.objects.filter(team=team).exists()
    key, _ = api_key_create(team=team, created_by=alice, priority_class="interactive")
    assert key.priority_class == "interactive"


def test_it_refuses_an_unknown_class(team):
    with pytest.raises(ApplicationError) as refused:
        api_key_create(team=team, priority_class="urgent")
    assert refused.value.field == "priority_class"


def test_only_staff_set_a_teams_class_through_the_api(alice, bob, team):
    url = f"/api/v1/teams/{team.slug}/"
    refused = logged_in(bob).patch(url, {"priority_class": "batch"}, content_type="application/json")
    assert refused.status_code == 403
    response = logged_in(alice).patch(url, {"priority_class": "batch"}, content_type="application/json")
    assert response.status_code == 200 and response.json()["priority_class"] == "batch"
    team.refresh_from_db()
    assert team.priority_class == "batch"


def test_the_flush_stores_the_class_and_an_old_record_without_one_is_interactive(team, gw):
    key, _ = api_key_create(team=team)
    batch = {**record(team, key), "priority_class": "batch"}
    old = record(team, key)  # queued by a gateway from before classes
    gw.rpush(redis_keys().usage, json.dumps(batch), json.dumps(old))
    assert usage_flush() == 2
    assert dict(Usage.objects.values_list("request_id", "priority_class")) == {
        uuid.UUID(batch["request_id"]): "batch",
        uuid.UUID(old["request_id"]): "interactive",
    }


def test_the_usage_page_and_the_api_split_usage_by_class(bob, charlie, team, gw):
    key, _ = api_key_create(team=team)
    records = [
        {**record(team, key, prompt=1, completion=2), "priority_class": "batch"},
        {**record(team, key, prompt=1, completion=2), "priority_class": "batch"},
        {**record(team, key, prompt=10, completion=20), "priority_class": "interactive"},
    ]
    gw.rpush(redis_keys().usage, *[json.dumps(r) for r in records])
    usage_flush()
    yesterday = timezone.now().date() - dt.timedelta(days=1)
    UsageDaily.objects.create(
        day=yesterday, team=team, model="m1", priority_class="batch", requests=5, prompt_tokens=50,
        completion_tokens=50,
    )  # fmt: skip
    page = logged_in(bob).get(reverse("teams:usage", args=["search"])).content.decode()
    assert "By priority class" in page
    # The 30 days are yesterday's rollup and today's records (never today's figures beside stale totals).
    assert '<tr><td>batch</td><td class="num">2</td><td class="num">6</td><td class="num">7</td>' in page
    api = logged_in(bob).get(f"/api/v1/teams/{team.slug}/usage/").json()
    rows = {r["priority_class"]: r for r in api}
    assert rows["batch"] == {
        "priority_class": "batch", "today_requests": 2, "today_tokens": 6, "days_requests": 7,
        "days_tokens": 106,
    }  # fmt: skip
    assert rows["interactive"]["today_tokens"] == 30
    assert logged_in(charlie).get(f"/api/v1/teams/{team.slug}/usage/").status_code == 404


def test_it_keeps_a_members_key_at_or_below_the_teams_class_unless_staff_set_it(alice, bob, team):
    member, _ = api_key_create(team=team, created_by=bob, priority_class="interactive")
    staff, _ = api_key_create(team=team, created_by=alice, priority_class="interactive")
    batch, _ = api_key_create(team=team, created_by=bob, priority_class="batch")
    team.priority_class = "batch"
    team.save()
    classes = {k.pk: k.effective_priority_class() for k in ApiKey.objects.filter(team=team)}
    assert classes == {member.pk: "batch", staff.pk: "interactive", batch.pk: "batch"}
    page = logged_in(bob).get(reverse("teams:keys", args=["search"])).content.decode()
    assert 'batch <span class="muted">(team\'s; the key asked interactive)</span>' in page
    # Staff give the member's key a class in the admin: it is staff's from then on.
    alice.is_superuser = True  # the admin's change permission
    alice.save()
    admin = logged_in(alice)
    url = reverse("admin:teams_apikey_change", args=[member.pk])
    form = {"name": "", "allowed_models": "[]", "priority_class": "batch"}
    assert admin.post(url, form).status_code == 302
    form["priority_class"] = "interactive"
    assert admin.post(url, form).status_code == 302
    member.refresh_from_db()
    assert member.priority_class_set_by_staff and member.effective_priority_class() == "interactive"
