"""A rollout driven from its pages in Chromium (issue 26): start it from the form, watch it warm up
and take its first step, pause, resume and roll back with the buttons, and read the timeline."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import Page, expect

from tests.helpers.browser import login, shot
from tests.helpers.rollouts import make_pair, shares_of

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.browser]


def _press(page: Page, label: str, state: str) -> None:
    page.get_by_role("button", name=label).click()
    expect(page.locator("h1 .badge")).to_have_text(state)


def test_staff_drive_a_rollout_from_the_page_and_see_its_timeline(
    page: Page, live_server, alice, team, cpu_node
):
    from portal.rollouts.models import Rollout
    from portal.rollouts.services import rollouts_advance_all

    pair = make_pair(team=team, node=cpu_node)
    login(page, live_server, "alice", "alice-password", next_path="/rollouts/new/")
    page.select_option("#id_served_model", pair.served.name)
    page.select_option("#id_to_deployment", pair.new.name)
    page.select_option("#id_from_deployment", pair.old.name)
    page.fill("#id_steps", "10x30s, 50x1, 100x1")
    page.fill("#id_interval_s", "5")
    page.get_by_role("button", name="Start").click()
    expect(page).to_have_url(re.compile(r"/rollouts/\d+/$"))
    expect(page.locator("h1 .badge")).to_have_text("warming")
    expect(page.locator("body")).to_contain_text("Measured every 5 s")
    rollout = Rollout.objects.get(served_model=pair.served)
    assert rollout.steps[0] == {"share_percent": 10, "seconds": 30}

    rollouts_advance_all()  # one tick of the control task: the new deployment serves, step 1 begins
    page.reload()
    expect(page.locator("h1 .badge")).to_have_text("stepping")
    expect(page.locator("tr.current")).to_contain_text("10 %")
    expect(page.locator("tr.current")).to_contain_text("30 s")

    _press(page, "Pause", "paused")
    expect(page.get_by_role("button", name="Resume")).to_be_visible()
    _press(page, "Resume", "stepping")
    _press(page, "Roll back", "rolled back")
    expect(page.get_by_role("button", name="Promote now")).to_have_count(0)  # nothing left to drive
    expect(page.locator(".reason")).to_contain_text("rolled back by alice")

    timeline = page.locator("h2:has-text('Timeline') + table")
    for kind in ("start", "step", "pause", "resume", "roll_back"):
        expect(timeline).to_contain_text(kind)
    assert shares_of(pair.served)[pair.new.model_version.name] == 0
    shot(page, "rollout-rolled-back")

    # A second rollout of the same name, promoted from the page.
    page.goto(f"{live_server.url}/rollouts/new/")
    page.select_option("#id_served_model", pair.served.name)
    page.select_option("#id_to_deployment", pair.new.name)
    page.fill("#id_steps", "50x1, 100x1")
    page.get_by_role("button", name="Start").click()
    expect(page.locator("h1 .badge")).to_have_text("warming")
    _press(page, "Promote now", "promoted")
    expect(page.locator("h2:has-text('Timeline') + table")).to_contain_text("promoted:")
    assert shares_of(pair.served) == {pair.old.model_version.name: 0, pair.new.model_version.name: 10_000}
