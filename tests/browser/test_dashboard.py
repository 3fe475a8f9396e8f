"""The front page in Chromium: the ops dashboard (staff) and a member's team front page."""

from __future__ import annotations

import math
import time
import uuid

import pytest
import redis
from django.conf import settings
from django.core.management import call_command
from django.utils import timezone
from playwright.sync_api import Page, expect

from portal.core.redis.client import redis_keys
from tests.helpers.browser import login, shot

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def busy_portal(team, alice):
    """The demo fleet with three deployments, an hour of gateway traffic, runs, keys and usage."""
    from portal.benchmarks.models import BenchmarkLevel, BenchmarkRun
    from portal.deployments.models import Deployment, DeploymentProfile, MetricsSample
    from portal.inventory.models import Node
    from portal.observability import prometheus
    from portal.registry.models import ModelVersion
    from portal.teams.models import Team, Usage
    from portal.teams.services import api_key_create, api_key_revoke

    client = redis.Redis.from_url(settings.GATEWAY_REDIS_URL)
    keys = redis_keys()
    stale = [*client.scan_iter(f"{keys.metrics}*"), *client.scan_iter(f"{keys.gateway}*")]
    if stale:
        client.delete(*stale)
    call_command("seed_demo", verbosity=0)
    platform = Team.objects.get(slug="platform")
    dgx, pcie = Node.objects.get(name="dgx-v100-01"), Node.objects.get(name="pcie-v100-01")

    def deploy(name, team, model, profile, node, gpus, state, **extra):
        return Deployment.objects.create(
            name=name, team=team, model_version=ModelVersion.objects.get(name=model),
            profile=DeploymentProfile.objects.get(name=profile), node=node, gpu_indices=gpus,
            desired_state="running" if state != "stopped" else "stopped", state=state,
            endpoint_url="http://127.0.0.1:9" if state == "serving" else "", **extra,
        )  # fmt: skip

    chat = deploy("llama13b-chat", team, "llama-2-13b-chat-hf", "v100-13b-fp16-tp2", dgx, [0, 1], "serving",
                  concurrency_cap=48)  # fmt: skip
    gemma = deploy(
        "gemma27b", platform, "gemma-2-27b-it-gptq-4bit", "v100-16g-27b-gptq", pcie, [0], "serving"
    )
    deploy("llama7b-tp8", platform, "llama-2-7b-chat-hf", "v100-7b-fp16-tp8", dgx, list(range(8)), "stopped")
    MetricsSample.objects.create(deployment=chat, healthy=True, running=21, waiting=3, kv_cache_usage=0.63)
    MetricsSample.objects.create(deployment=gemma, healthy=False)

    now = time.time()
    for minute in range(60):
        at = now - (59 - minute) * 60
        load = 30 + 20 * math.sin(minute / 9)
        for i in range(int(load)):
            prometheus.gateway_request_ended(
                endpoint="chat", model="llama-2-13b-chat-hf", status="completed", http_status=200,
                duration_s=2.0, ttft_s=0.2, prompt_tokens=380 + i % 40, completion_tokens=240, at=at,
            )  # fmt: skip
        if 38 <= minute <= 41:
            for _ in range(4):
                prometheus.gateway_request_ended(
                    endpoint="chat", model="gemma-2-27b-it-gptq-4bit", status="upstream_error",
                    http_status=502, error_code="upstream_error", at=at,
                )  # fmt: skip
        for _ in range(minute % 7 == 0):
            prometheus.gateway_request_ended(
                endpoint="chat", model="", status="rejected", http_status=429,
                error_code="rate_limit_exceeded", at=at,
            )  # fmt: skip
        prometheus.minute_max("queue_depth", max(0, int(load) - 40), at=at)
    assert prometheus.recorder.flush()

    done = BenchmarkRun.objects.create(
        deployment=chat, profile=chat.profile, mix="field-mix", state="done", sla_concurrency=32,
        sla_reason="32 meets the SLA; 64 misses P95 TTFT", title="13B after the cap change",
    )  # fmt: skip
    for i, c in enumerate((8, 16, 32, 64)):
        BenchmarkLevel.objects.create(run=done, index=i, concurrency=c, results={"concurrency": c})
    BenchmarkRun.objects.create(deployment=gemma, mix="short-qa", state="failed", state_reason="no replica")

    team.tokens_per_day = 2_000_000
    team.max_concurrent = 32
    team.rpm_limit = 600
    team.save()
    kept, _ = api_key_create(
        team=team, name="search-backend", allowed_models=["llama-2-13b-chat-hf"], rpm_limit=300
    )
    old, _ = api_key_create(team=team, name="notebook")
    api_key_revoke(api_key=old)
    Usage.objects.create(
        request_id=uuid.uuid4(), created_at=timezone.now(), team=team, api_key=kept,
        model="llama-2-13b-chat-hf", status="completed", http_status=200,
        prompt_tokens=900_000, completion_tokens=350_000, duration_ms=900,
    )  # fmt: skip
    yield kept
    client.close()


def test_staff_see_the_ops_dashboard(page: Page, live_server, busy_portal):
    login(page, live_server, "alice", "alice-password")
    expect(page.get_by_role("heading", name="Overview")).to_be_visible()
    nodes = page.locator("#nodes")
    expect(nodes.locator("tr", has_text="dgx-v100-01")).to_contain_text("2 / 8")
    expect(nodes.locator("tr", has_text="pcie-v100-01")).to_contain_text("1 / 1")
    deployments = page.locator("#deployments")
    expect(deployments.locator("tr", has_text="llama13b-chat")).to_contain_text("healthy")
    expect(deployments.locator("tr", has_text="gemma27b")).to_contain_text("failing")
    expect(page.locator("svg.chart")).to_have_count(5)
    expect(page.locator("#runs")).to_contain_text("32 concurrent")
    shot(page, "dashboard-ops")


def test_a_member_sees_the_team_front_page(page: Page, live_server, bob, busy_portal):
    key = busy_portal
    login(page, live_server, "bob", "bob-password")
    section = page.locator("#team-search")
    expect(section.get_by_role("heading", name="Team Search")).to_be_visible()
    expect(section.locator("table.keys")).to_contain_text(f"sk-{key.prefix}…")
    expect(section.locator("table.keys")).to_contain_text("revoked")
    expect(section.locator("table.models")).to_contain_text("llama-2-13b-chat-hf")
    expect(section).to_contain_text("1,250,000 / 2,000,000")
    # How to call: the base URL, and each model's context and max_tokens bound.
    expect(section.locator("code.base-url")).to_have_text(f"{live_server.url}/v1")
    expect(section.locator("table.models tr", has_text="llama-2-13b-chat-hf")).to_contain_text("4,096")
    expect(page.locator("#nodes")).to_have_count(0)
    shot(page, "dashboard-team")
