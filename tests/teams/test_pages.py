"""Team self-service pages: keys (create shown once, list, revoke), usage with charts; scoping."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from django.test import Client
from django.urls import reverse

from portal.teams.models import ApiKey
from portal.teams.services import api_key_create, api_key_matches
from tests.helpers import builders
from tests.helpers.usage import usage_row

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("gateway_redis_db")]


def logged_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_a_member_creates_a_key_and_sees_it_once(bob, team, models_m1_m2):
    client = logged_in(bob)
    response = client.post(
        reverse("teams:keys", args=["search"]), {"name": "ci", "models": "m1, m2", "rpm_limit": 30}
    )
    assert response.status_code == 200
    token = response.context["new_token"]
    key = ApiKey.objects.get(team=team)
    assert api_key_matches(token, key.digest)
    assert (key.name, key.allowed_models, key.rpm_limit, key.created_by) == ("ci", ["m1", "m2"], 30, bob)
    assert token in response.content.decode()
    assert "no-store" in response["Cache-Control"] or "max-age=0" in response["Cache-Control"]
    again = client.get(reverse("teams:keys", args=["search"])).content.decode()
    assert token not in again and f"sk-{key.prefix}" in again


def test_the_key_form_refuses_a_model_the_team_cannot_call_and_names_the_close_one(bob, team, llama7b):
    url = reverse("teams:keys", args=["search"])
    response = logged_in(bob).post(url, {"name": "nb", "models": "llama-2-7b-chat"})
    assert response.status_code == 400 and not ApiKey.objects.exists()
    page = response.content.decode()
    assert "`llama-2-7b-chat` is not a model your team can call. Did you mean `llama-2-7b-chat-hf`?" in page
    assert "from: llama-2-7b-chat-hf" in page  # the form's help lists what the team can call
    assert "snippet-curl" not in page
    # A registered model outside the team's allowed list is refused the same way.
    team.allowed_models = ["m-other"]
    team.save()
    response = logged_in(bob).post(url, {"name": "nb", "models": "llama-2-7b-chat-hf"})
    assert response.status_code == 400 and "is not a model your team can call" in response.content.decode()


def test_the_key_list_shows_prefix_and_last_use(bob, team):
    key, token = api_key_create(team=team, name="batch")
    page = logged_in(bob).get(reverse("teams:keys", args=["search"])).content.decode()
    assert f"sk-{key.prefix}…" in page and "batch" in page and "never" in page
    assert token.split(".", 1)[1] not in page


def test_a_member_revokes_a_key_after_a_confirmation_page(bob, team):
    key, _ = api_key_create(team=team, name="nightly")
    client = logged_in(bob)
    keys = client.get(reverse("teams:keys", args=["search"])).content.decode()
    url = reverse("teams:key-revoke", args=["search", key.prefix])
    assert f'href="{url}">Revoke…</a>' in keys  # a link to the confirmation, not a one-click form
    confirm = client.get(url)
    assert confirm.status_code == 200 and "nightly" in confirm.content.decode()
    key.refresh_from_db()
    assert key.revoked_at is None  # looking revokes nothing
    response = client.post(url)
    assert response.status_code == 302
    key.refresh_from_db()
    assert key.revoked_at is not None


def test_charlie_sees_no_team_pages_and_revokes_nothing(charlie, team):
    key, _ = api_key_create(team=team)
    client = logged_in(charlie)
    for name in ("deployments:team-detail", "teams:keys", "teams:usage"):
        assert client.get(reverse(name, args=["search"])).status_code == 404
    assert client.post(reverse("teams:keys", args=["search"]), {"name": "x"}).status_code == 404
    assert client.post(reverse("teams:key-revoke", args=["search", key.prefix])).status_code == 404
    key.refresh_from_db()
    assert key.revoked_at is None and ApiKey.objects.count() == 1


def test_another_teams_member_cannot_revoke_through_their_own_team(bob, team, django_user_model):

    other = builders.team(name="Ads", slug="ads")
    dave = django_user_model.objects.create_user("dave")
    other.members.add(dave)
    key, _ = api_key_create(team=team)
    assert logged_in(dave).post(reverse("teams:key-revoke", args=["ads", key.prefix])).status_code == 404


def test_the_usage_page_shows_quotas_and_svg_charts(bob, team):
    team.tokens_per_day = 100000
    team.save()
    page = logged_in(bob).get(reverse("teams:usage", args=["search"])).content.decode()
    assert page.count("<svg") == 2
    assert "daily quota" in page and "100,000" in page


def test_the_usage_page_folds_today_into_the_30_day_totals_with_thousands_separators(bob, team):
    """The 30-day figures once lagged today's live ones until the rollup ran (`Requests today 1074`
    beside `Requests, 30 days 95`)."""
    import datetime as dt
    import re
    import uuid

    from django.utils import timezone

    from portal.teams.models import Usage, UsageDaily

    today = timezone.now().date()
    for day, requests, tokens in [(today - dt.timedelta(days=1), 95, 20_000), (today, 50, 1_000)]:
        UsageDaily.objects.create(
            day=day,
            team=team,
            model="m",
            requests=requests,
            completed=requests,
            prompt_tokens=tokens,
            completion_tokens=0,
        )  # fmt: skip  (today's row: a rollup minutes behind the records)
    Usage.objects.bulk_create(
        Usage(
            request_id=uuid.uuid4(), created_at=timezone.now(), team=team, model="m", status="completed",
            http_status=200, prompt_tokens=200, completion_tokens=50, duration_ms=9,
        )
        for _ in range(1_200)
    )  # fmt: skip
    page = logged_in(bob).get(reverse("teams:usage", args=["search"])).content.decode()
    assert re.search(r"Requests today</div><div class=\"big\">1,200<", page)
    row = '<tr><td>interactive</td><td class="num">1,200</td><td class="num">300,000</td>'
    assert row + '<td class="num">1,295</td><td class="num">320,000</td></tr>' in page
    assert f"{today:%m-%d}: 300,000</title>" in page  # today's bar: the records, not the stale rollup


def test_staff_sees_the_admin_usage_chart(alice, team):
    alice.is_superuser = True
    alice.save()
    response = logged_in(alice).get(reverse("admin:teams_usagedaily_changelist"))
    assert response.status_code == 200
    assert "<svg" in response.content.decode()


def test_the_admin_never_shows_a_keys_digest(alice, team):
    alice.is_superuser = True
    alice.save()
    key, _ = api_key_create(team=team)
    page = logged_in(alice).get(reverse("admin:teams_apikey_change", args=[key.pk])).content.decode()
    assert key.digest not in page


def test_every_page_links_a_member_to_their_team(bob, charlie, team):
    link = '<a href="/teams/search/" class="team-link"'
    assert link in logged_in(bob).get("/nodes/").content.decode()
    assert link not in logged_in(charlie).get("/nodes/").content.decode()


@pytest.fixture
def hung_redis(settings):
    """A Redis that takes connections and never answers; closed after 15 s so nothing waits forever."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)  # the kernel completes each connect; nobody ever reads or writes
    settings.GATEWAY_REDIS_URL = f"redis://127.0.0.1:{server.getsockname()[1]}/0"
    settings.GATEWAY_REDIS_TIMEOUT_S = 0.5
    watchdog = threading.Timer(15, server.close)
    watchdog.start()
    yield
    watchdog.cancel()
    server.close()


def test_the_usage_page_answers_at_once_while_redis_hangs(bob, team, hung_redis):
    team.max_concurrent = 4
    team.save()
    started = time.monotonic()
    response = logged_in(bob).get(reverse("teams:usage", args=["search"]))
    elapsed = time.monotonic() - started
    assert response.status_code == 200
    assert elapsed < 5, f"the page waited {elapsed:.1f} s on a hung Redis"
    assert "— / 4" in response.content.decode()  # in flight: unknown, not a made-up 0


@pytest.mark.parametrize(
    ("field", "value"),
    [("rpm_limit", "2147483648"), ("tpm_limit", "99999999999"), ("tokens_per_day", "9223372036854775808")],
)
def test_the_key_form_answers_400_naming_a_limit_too_large_for_its_column(bob, team, field, value):
    response = logged_in(bob).post(reverse("teams:keys", args=["search"]), {"name": "big", field: value})
    assert response.status_code == 400
    assert list(response.context["form"].errors) == [field]
    assert "less than or equal to" in response.content.decode()
    assert not ApiKey.objects.filter(team=team).exists()


def test_the_usage_page_leaves_refused_prompts_out_of_tokens_today(bob, team):
    from portal.teams.models import Usage

    usage_row(team, status="completed", http_status=200, prompt_tokens=100, completion_tokens=20)
    usage_row(team, status="rejected", http_status=429, prompt_tokens=75_004, completion_tokens=0)
    assert Usage.objects.count() == 2
    page = logged_in(bob).get(reverse("teams:usage", args=["search"])).content.decode()
    assert '<div class="big">120 / ∞</div>' in page


def test_the_usage_page_shows_outages_apart_from_refusals(bob, team):
    for _ in range(3):
        usage_row(team, status="unavailable", http_status=503, prompt_tokens=0, completion_tokens=0)
    usage_row(team, status="rejected", http_status=429, prompt_tokens=0, completion_tokens=0)
    page = logged_in(bob).get(reverse("teams:usage", args=["search"])).content.decode()
    assert '<td>outage (no replica or the portal unavailable)</td><td class="num">3</td>' in page
    assert '<td>refused (quota, rate limit, bad request)</td><td class="num">1</td>' in page
