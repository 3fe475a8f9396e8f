"""The front page: staff get the ops dashboard, members their teams' front page, others nothing."""

from __future__ import annotations

import re
import time
import uuid

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from portal.benchmarks.models import BenchmarkLevel, BenchmarkRun
from portal.core.redis.client import redis_keys
from portal.deployments.models import MetricsSample
from portal.observability import prometheus
from portal.observability.services import queue_depth_sample
from portal.registry.services import model_version_create
from portal.teams.models import Usage
from portal.teams.services import api_key_create
from tests.helpers import builders
from tests.helpers.samples import bundled_config

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("metrics_redis")]


def deploy(name, *, team, model, node=None, gpus=(), state="serving", profile=None, cap=None, shared=False):
    return builders.deployment(
        name=name, team=team, model_version=model, profile=profile, node=node, gpu_indices=list(gpus),
        shared=shared,
        desired_state="running" if state in ("serving", "starting") else "stopped", state=state,
        endpoint_url="http://127.0.0.1:9/" if state == "serving" else "", concurrency_cap=cap,
    )  # fmt: skip


@pytest.fixture
def fleet(team, dgx, pcie_box, llama7b, profile_tp8, profile_tp1, django_user_model):
    """dgx: 8 GPUs held by a serving 7B (healthy); pcie: 1 of 4 held by a failing one; one stopped."""
    big = deploy(
        "llama7b-tp8", team=team, model=llama7b, node=dgx, gpus=range(8), profile=profile_tp8, cap=16
    )
    small = deploy("llama7b-pcie", team=team, model=llama7b, node=pcie_box, gpus=[2], profile=profile_tp1)
    deploy(
        "llama7b-old", team=team, model=llama7b, node=pcie_box, gpus=[0], profile=profile_tp1, state="stopped"
    )
    MetricsSample.objects.create(deployment=big, healthy=False, running=0, waiting=0)
    MetricsSample.objects.create(deployment=big, healthy=True, running=5, waiting=2, kv_cache_usage=0.42)
    MetricsSample.objects.create(deployment=small, healthy=False)
    run = BenchmarkRun.objects.create(
        deployment=big, profile=profile_tp8, mix="field-mix", state="done", sla_concurrency=64,
        sla_reason="64 meets the SLA; 128 misses P95 TTFT",
    )  # fmt: skip
    for i, c in enumerate((16, 32, 64, 128)):
        BenchmarkLevel.objects.create(run=run, index=i, concurrency=c, results={"concurrency": c})
    return big, small, run


def test_staff_see_gpu_occupancy_per_node(client, alice, fleet, dgx, pcie_box):
    client.force_login(alice)
    page = client.get("/").content.decode()
    rows = _rows(page, "nodes")
    assert "8 / 8" in rows["dgx-v100-01"]
    assert "1 / 4" in rows["pcie-v100-04"]  # the stopped deployment's GPU 0 is free
    assert "9 / 12" in page  # the GPUs-held card


def test_staff_see_each_deployment_with_its_last_health_check(client, alice, fleet):
    client.force_login(alice)
    rows = _rows(client.get("/").content.decode(), "deployments")
    assert "healthy" in rows["llama7b-tp8"]  # the later of its two samples
    assert "5 / 2" in rows["llama7b-tp8"] and "42%" in rows["llama7b-tp8"]
    assert "failing" in rows["llama7b-pcie"]
    assert "stopped" in rows["llama7b-old"] and "healthy" not in rows["llama7b-old"]


def test_staff_see_recent_benchmark_runs_with_their_sla_point(client, alice, fleet):
    _big, _small, run = fleet
    client.force_login(alice)
    rows = _rows(client.get("/").content.decode(), "runs")
    row = rows[f"#{run.pk}"]
    assert "64 concurrent" in row and "field-mix" in row and ">4<" in row  # four levels


def test_staff_see_the_last_hour_of_gateway_traffic(client, alice, fleet):
    now = time.time()
    for minutes_ago, n in [(50, 3), (2, 6)]:
        for _ in range(n):
            prometheus.gateway_request_ended(
                endpoint="chat", model="llama-2-7b-chat-hf", status="completed", http_status=200,
                duration_s=1.0, ttft_s=0.1, prompt_tokens=100, completion_tokens=20,
                at=now - minutes_ago * 60,
            )  # fmt: skip
    prometheus.gateway_request_ended(
        endpoint="chat", model="llama-2-7b-chat-hf", status="upstream_error", http_status=502,
        error_code="upstream_error", at=now - 120,
    )  # fmt: skip
    prometheus.gateway_request_ended(
        endpoint="chat",
        model="",
        status="rejected",
        http_status=401,
        error_code="invalid_api_key",
        at=now - 60,
    )
    prometheus.minute_max("queue_depth", 7, at=now - 60)
    prometheus.minute_max("queue_depth", 3, at=now - 60)  # a later, smaller sample keeps the max
    assert prometheus.recorder.flush()
    client.force_login(alice)
    response = client.get("/")
    page = response.content.decode()
    assert page.count('<svg class="chart"') == 5
    traffic = response.context["traffic"]
    assert len(traffic) == 60
    assert sum(m.requests for m in traffic) == 11
    by_minute = {m.start.timestamp() // 60: m for m in traffic}
    two_ago = by_minute[(now - 120) // 60]
    assert (two_ago.requests, two_ago.errors, two_ago.tokens) == (7, 1, 720)
    assert two_ago.requests_per_s == pytest.approx(7 / 60)
    assert by_minute[(now - 60) // 60].queue_depth == 7
    assert by_minute[(now - 60) // 60].rejected == 1
    assert response.context["traffic_totals"] == {"requests": 11, "tokens": 1080, "errors": 1, "rejected": 1}


def test_the_beat_task_samples_the_real_queue_depth(fleet, metrics_redis):
    _big, _small, _run = fleet
    now_ms = int(time.time() * 1000)
    queue = redis_keys().queue("llama-2-7b-chat-hf")
    metrics_redis.zadd(queue, {"a": now_ms, "b": now_ms, "c": now_ms - 10**7})
    assert queue_depth_sample() == 2  # the entry left by a process that died long ago is not counted


def test_the_dashboard_says_so_when_redis_is_down(client, alice, fleet, settings):
    settings.GATEWAY_REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens on port 1
    client.force_login(alice)
    page = client.get("/").content.decode()
    assert "unreachable" in page
    assert "llama7b-tp8" in page  # the rest of the dashboard still renders


def test_the_dashboard_costs_the_same_queries_however_big_the_fleet(
    client, alice, fleet, team, llama7b, django_assert_max_num_queries
):
    client.force_login(alice)
    client.get("/")  # warm the session
    with CaptureQueriesContext(connection) as small:
        assert client.get("/").status_code == 200
    for i in range(10):
        d = deploy(f"extra-{i}", team=team, model=llama7b)
        MetricsSample.objects.create(deployment=d, healthy=True)
        BenchmarkRun.objects.create(deployment=d, mix="short-qa", state="done")
    # 15: the header's team links (base.html) cost one query on every page; open SLA breaches one;
    # the GPUs not healthy one; the batch load per model one.
    with django_assert_max_num_queries(16), CaptureQueriesContext(connection) as large:
        assert client.get("/").status_code == 200
    assert len(large) == len(small)


# --- the team front page ------------------------------------------------------------


@pytest.fixture
def two_teams(team, llama7b, qwen_bf16, fleet):
    """bob's team "search" and team "ads" (not his), each with a key and usage today."""
    ads = builders.team(name="Ads", slug="ads")
    team.tokens_per_day = 10_000
    team.max_concurrent = 4
    team.save()
    search_key, search_token = api_key_create(team=team, name="notebook", rpm_limit=60)
    ads_key, _ = api_key_create(team=ads, name="ads-batch")
    deploy("qwen", team=ads, model=qwen_bf16, shared=True)  # ops share it with every team
    mistral = model_version_create(
        name="mistral-7b-instruct", config=bundled_config("mistral-7b-instruct-v0.3")
    )
    deploy("mistral-ads", team=ads, model=mistral)  # ads' own: search's keys cannot reach it
    for t, key, tokens in [(team, search_key, 2_500), (ads, ads_key, 77_777)]:
        Usage.objects.create(
            request_id=uuid.uuid4(), created_at=timezone.now(), team=t, api_key=key,
            model="llama-2-7b-chat-hf", status="completed", http_status=200,
            prompt_tokens=tokens - 500, completion_tokens=500, duration_ms=9,
        )  # fmt: skip
    # Usage of an earlier day does not count today.
    Usage.objects.create(
        request_id=uuid.uuid4(), created_at=timezone.now() - timezone.timedelta(days=2), team=team,
        model="llama-2-7b-chat-hf", status="completed", http_status=200, prompt_tokens=99_000, duration_ms=9,
    )  # fmt: skip
    return team, ads, search_key, search_token, ads_key


def test_a_member_sees_their_teams_models_keys_quotas_and_usage_today(client, bob, two_teams):
    _team, _ads, search_key, search_token, _ads_key = two_teams
    client.force_login(bob)
    response = client.get("/")
    page = response.content.decode()
    assert "Team Search" in page
    assert f"sk-{search_key.prefix}…" in page and "notebook" in page
    assert "2,500 / 10,000" in page  # tokens today against the daily quota
    assert '<meter min="0" max="10000"' in page
    assert "llama-2-7b-chat-hf" in page and "qwen2.5-7b-instruct" in page  # its own and shared replicas
    assert "mistral-7b-instruct" not in page  # another team's unshared deployment
    # No secret: neither the key nor its digest.
    assert search_token.split(".", 1)[1] not in page and search_key.digest not in page
    assert next(t.name for t in response.templates) == "dashboard/team_home.html"
    assert "dgx-v100-01" not in page  # no ops dashboard


def test_a_member_never_sees_another_teams_keys_or_usage(client, bob, two_teams):
    _team, _ads, _key, _token, ads_key = two_teams
    client.force_login(bob)
    page = client.get("/").content.decode()
    assert ads_key.prefix not in page and "ads-batch" not in page
    assert "77777" not in page and "Team Ads" not in page


def test_a_member_sees_only_the_models_the_team_may_call(client, bob, two_teams):
    team = two_teams[0]
    team.allowed_models = ["qwen2.5-7b-instruct"]
    team.save()
    client.force_login(bob)
    models = _section(client.get("/").content.decode(), 'class="models"')
    assert "qwen2.5-7b-instruct" in models and "llama-2-7b-chat-hf" not in models


def test_a_member_sees_how_to_call_each_model_base_url_context_and_max_tokens(client, bob, two_teams):

    team = two_teams[0]
    tiny = model_version_create(name="tiny-llama", config=bundled_config("llama-2-7b-chat-hf"))
    short = builders.profile(name="t", max_model_len=512)
    deploy("tiny", team=team, model=tiny, profile=short)
    client.force_login(bob)
    page = client.get("/").content.decode()
    assert '<code class="base-url">http://testserver/v1</code>' in page
    rows = _rows(page, "models-search")
    # The clamp (1024) bounds a 4096-token model; a 512-token model is bounded by its context less the prompt.
    cells = {m: re.sub(r"<[^>]+>", " ", row).split()[1:] for m, row in rows.items()}
    assert [cells["llama-2-7b-chat-hf"], cells["tiny-llama"]] == [
        ["2", "4,096", "1,024", "1,024"],
        ["1", "512", "512", "−", "prompt", "512", "−", "prompt"],
    ]
    # qwen is shared and profile-less: its context is the model's own positions.
    assert "32,768" in rows["qwen2.5-7b-instruct"]


def test_someone_in_no_team_is_told_so_and_sees_no_keys(client, charlie, two_teams):
    client.force_login(charlie)
    page = client.get("/").content.decode()
    assert "not a member of any team" in page
    assert "sk-" not in page and "Team " not in page


def test_the_team_front_page_costs_the_same_queries_for_more_teams_and_keys(
    client, bob, two_teams, django_assert_max_num_queries
):
    client.force_login(bob)
    client.get("/")
    with CaptureQueriesContext(connection) as small:
        client.get("/")
    for i in range(5):
        extra = builders.team(name=f"T{i}", slug=f"t{i}")
        extra.members.add(bob)
        for _ in range(3):
            api_key_create(team=extra)
    # 8: the names a key calls (served names, versions hidden by name) are one query more (issue 37);
    # 9: the versions that served each team's requests in the last 24 h, one query for all teams.
    with django_assert_max_num_queries(9), CaptureQueriesContext(connection) as large:
        page = client.get("/").content.decode()
    assert page.count("<section") == 6
    assert len(large) == len(small)


def _section(page: str, marker: str) -> str:
    start = page.index(marker)
    return page[start : page.index("</table>", start)]


def _rows(page: str, table_id: str) -> dict[str, str]:
    """First cell's text → the row's HTML, for the table with that id."""
    import re

    table = _section(page, f'id="{table_id}"')
    rows = {}
    for row in re.findall(r"<tr>(.*?)</tr>", table, re.S):
        first = re.search(r"<td>(.*?)</td>", row, re.S)
        if first:
            rows[re.sub(r"<[^>]+>", "", first.group(1)).split()[0]] = row
    return rows


def _served(team, deployment, count: int) -> None:
    """`count` completed requests of `team` to the served name "chat" that `deployment` answered."""
    for _ in range(count):
        Usage.objects.create(
            request_id=uuid.uuid4(), created_at=timezone.now(), team=team, model="chat",
            deployment=deployment, status="completed", http_status=200, duration_ms=9,
        )  # fmt: skip


def test_a_member_sees_each_version_that_served_their_served_name_with_its_count(
    client, bob, two_teams, llama7b, qwen_bf16
):
    team, *_ = two_teams
    old, new = deploy("chat-old", team=team, model=llama7b), deploy("chat-new", team=team, model=qwen_bf16)
    _served(team, new, 3)
    _served(team, old, 2)
    client.force_login(bob)
    table = _section(client.get("/").content.decode(), f'id="served-by-{team.slug}"')
    rows = re.findall(r"<tr><td>(.*?)</tr>", table, re.S)
    assert [re.sub(r"<[^>]+>", " ", row).split() for row in rows] == [
        ["chat", qwen_bf16.name, "3"],
        ["chat", llama7b.name, "2"],
    ]


def test_a_member_of_another_team_sees_none_of_the_first_teams_version_counts(
    client, bob, two_teams, llama7b, qwen_bf16
):
    team, ads, *_ = two_teams
    _served(team, deploy("chat-search", team=team, model=llama7b), 2)
    _served(ads, deploy("chat-ads", team=ads, model=qwen_bf16), 7)
    client.force_login(bob)
    page = client.get("/").content.decode()
    rows = re.findall(r"<tr><td>(.*?)</tr>", _section(page, f'id="served-by-{team.slug}"'), re.S)
    assert [re.sub(r"<[^>]+>", " ", row).split() for row in rows] == [["chat", llama7b.name, "2"]]
    assert f'id="served-by-{ads.slug}"' not in page
