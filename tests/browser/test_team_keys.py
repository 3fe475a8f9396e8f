"""A team member creates an API key (shown once), revokes it, and looks at usage charts, in Chromium."""

from __future__ import annotations

import uuid

import pytest
from django.utils import timezone
from playwright.sync_api import Page, expect

from tests.helpers.browser import login, shot

pytestmark = [
    pytest.mark.browser,
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("gateway_redis_db"),
]


def test_a_member_creates_sees_once_and_revokes_a_key(page: Page, live_server, bob, team, llama7b):
    login(page, live_server, "bob", "bob-password", next_path="/teams/search/keys/")
    page.fill("#id_name", "notebook")
    page.fill("#id_models", "llama-2-7b-chat")  # a typo: the form names the close model
    page.get_by_role("button", name="Create key").click()
    expect(page.locator("form.planner")).to_contain_text("Did you mean `llama-2-7b-chat-hf`?")
    expect(page.locator("#new-key")).to_have_count(0)
    page.fill("#id_models", "llama-2-7b-chat-hf")
    page.fill("#id_rpm_limit", "60")
    page.select_option("#id_priority_class", "batch")
    page.get_by_role("button", name="Create key").click()
    token = page.locator("#new-key").inner_text().strip()
    assert token.startswith("sk-")
    shot(page, "team-keys-created")
    prefix = token.removeprefix("sk-").split(".")[0]
    expect(page.locator("table")).to_contain_text(f"sk-{prefix}…")
    expect(page.locator("td.priority-class")).to_have_text("batch")

    page.goto(f"{live_server.url}/teams/search/keys/")
    expect(page.locator("#new-key")).to_have_count(0)
    assert token.split(".", 1)[1] not in page.content()
    page.get_by_role("link", name="Revoke…").click()  # a confirmation page first (no script needed)
    expect(page.locator("h1")).to_contain_text(f"Revoke key sk-{prefix}…?")
    expect(page.locator("main")).to_contain_text("notebook")
    page.get_by_role("link", name="Cancel").click()
    expect(page.locator("table")).not_to_contain_text("revoked")
    page.get_by_role("link", name="Revoke…").click()
    page.get_by_role("button", name="Revoke this key").click()
    expect(page.locator("table")).to_contain_text("revoked")
    expect(page.get_by_role("link", name="Revoke…")).to_have_count(0)


def test_a_member_sees_usage_against_quotas_as_charts(page: Page, live_server, bob, team):
    from portal.teams.models import Usage, UsageDaily

    team.tokens_per_day = 50_000
    team.max_concurrent = 8
    team.save()
    today = timezone.now().date()
    for days_ago, tokens in [(0, 32_000), (1, 41_000), (2, 12_000), (5, 55_000)]:
        UsageDaily.objects.create(
            day=today - timezone.timedelta(days=days_ago), team=team, model="m", requests=10, completed=10,
            prompt_tokens=tokens // 2, completion_tokens=tokens // 2,
        )  # fmt: skip
    Usage.objects.create(
        request_id=uuid.uuid4(), created_at=timezone.now(), team=team, model="m", status="completed",
        http_status=200, prompt_tokens=10, completion_tokens=20, duration_ms=50,
    )  # fmt: skip
    Usage.objects.create(
        request_id=uuid.uuid4(), created_at=timezone.now(), team=team, model="m", status="completed",
        http_status=200, prompt_tokens=1, completion_tokens=2, duration_ms=50, priority_class="batch",
    )  # fmt: skip
    login(page, live_server, "bob", "bob-password", next_path="/teams/search/usage/")
    expect(page.locator("svg.chart")).to_have_count(2)
    # Today per class: 1 interactive request of 30 tokens, 1 batch request of 3.
    expect(page.locator("table.by-class tr", has_text="batch")).to_contain_text("3")
    expect(page.locator("table.by-class tr", has_text="interactive")).to_contain_text("30")
    expect(page.locator("main")).to_contain_text("50,000")  # thousands separators
    shot(page, "team-usage")
