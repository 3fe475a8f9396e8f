"""Benchmark pages: history, run page with plots, compare, export, import, apply the cap; tenant scoping."""

from __future__ import annotations

import csv
import io

import pytest

from portal.benchmarks.models import BenchmarkLevel, BenchmarkRun, RunState
from portal.benchmarks.services import (
    FIELD_GUIDE_7B_TABLE,
    BenchmarkRunRequest,
    benchmark_import_table,
    benchmark_run_create,
)

pytestmark = pytest.mark.django_db


def level(concurrency: int, throughput: float, p95_ttft_ms: float, p95_tpot_ms: float) -> dict:
    return {
        "concurrency": concurrency,
        "completed": 32,
        "failed": 0,
        "output_throughput": throughput,
        "request_throughput": throughput / 100,
        "mean_ttft_ms": p95_ttft_ms / 2,
        "median_ttft_ms": p95_ttft_ms / 2,
        "p95_ttft_ms": p95_ttft_ms,
        "mean_tpot_ms": p95_tpot_ms / 2,
        "median_tpot_ms": p95_tpot_ms / 2,
        "p95_tpot_ms": p95_tpot_ms,
        "mean_e2el_ms": 1000.0,
        "little_law": {
            "ok": True,
            "ratio": 1.01,
            "measured_output_throughput": throughput,
            "expected_output_throughput": throughput / 1.01,
        },
        "errors": {},
    }


@pytest.fixture
def finished_run(bob, deployment):
    run = benchmark_run_create(
        user=bob,
        run_request=BenchmarkRunRequest(
            deployment=deployment, mix="fixed:16:8", concurrencies=[16, 32], requests_per_level=8
        ),
    )
    BenchmarkLevel.objects.create(
        run=run,
        index=0,
        concurrency=16,
        results=level(16, 1000, 800, 60),
        samples={"ttft_ms": [300, 400, 800], "tpot_ms": [20, 30, 60]},
    )
    BenchmarkLevel.objects.create(
        run=run,
        index=1,
        concurrency=32,
        results=level(32, 1500, 3500, 90),
        samples={"ttft_ms": [900, 1800, 3500], "tpot_ms": [40, 60, 90]},
    )
    BenchmarkRun.objects.filter(pk=run.pk).update(
        state=RunState.DONE,
        sla_concurrency=16,
        sla_reason="16 is the highest level meeting the SLA; 32 misses: P95 TTFT 3.50 s > 3 s",
    )
    run.refresh_from_db()
    return run


def test_it_shows_a_run_with_its_plots_and_sla_point(client, bob, finished_run):
    client.force_login(bob)
    page = client.get(finished_run.get_absolute_url()).content.decode()
    assert page.count("<svg") == 5  # throughput, TTFT, TPOT, and the two distributions of a level
    assert "Output throughput vs concurrency" in page
    assert "SLA P95 TTFT 3 s" in page
    assert "32 misses: P95 TTFT 3.50 s &gt; 3 s" in page
    assert "Concurrency 16" in page
    assert "http-equiv" not in page  # finished: no refresh


def test_it_refreshes_the_page_of_a_running_run(client, bob, deployment):
    run = benchmark_run_create(
        user=bob, run_request=BenchmarkRunRequest(deployment=deployment, concurrencies=[4])
    )
    client.force_login(bob)
    assert 'http-equiv="refresh"' in client.get(run.get_absolute_url()).content.decode()


def test_a_running_run_says_not_decided_yet_without_the_red_no_operating_point(client, bob, deployment):
    run = benchmark_run_create(
        user=bob, run_request=BenchmarkRunRequest(deployment=deployment, concurrencies=[4, 8])
    )
    BenchmarkLevel.objects.create(run=run, index=0, concurrency=4, results=level(4, 100, 80, 20))
    BenchmarkRun.objects.filter(pk=run.pk).update(state=RunState.RUNNING)
    client.force_login(bob)
    page = client.get(run.get_absolute_url()).content.decode()
    assert "Not decided yet" in page and "No operating point" not in page
    assert 'class="verdict refused" id="sla-verdict"' not in page
    BenchmarkRun.objects.filter(pk=run.pk).update(
        state=RunState.DONE, sla_reason="4 misses: P95 TTFT 4 s > 3 s"
    )
    page = client.get(run.get_absolute_url()).content.decode()
    assert "No operating point" in page and "4 misses" in page and "Not decided yet" not in page


def test_its_plots_are_scaled_to_the_data_not_to_a_far_sla(client, bob, deployment):
    run = benchmark_run_create(
        user=bob, run_request=BenchmarkRunRequest(deployment=deployment, concurrencies=[1])
    )
    BenchmarkLevel.objects.create(
        run=run, index=0, concurrency=1, results=level(1, 100, 40, 8),
        samples={"ttft_ms": [10 + i for i in range(30)], "tpot_ms": [4 + i / 10 for i in range(30)]},
    )  # fmt: skip
    client.force_login(bob)
    page = client.get(run.get_absolute_url()).content.decode()
    assert "SLA P95 TTFT 3 s: above this scale" in page and "SLA 3 s: right of this scale" in page


def test_it_hides_runs_from_another_team(client, charlie, finished_run):
    client.force_login(charlie)
    assert client.get(finished_run.get_absolute_url()).status_code == 404
    assert client.get(f"/benchmarks/{finished_run.pk}/export.json").status_code == 404
    assert client.get(f"/benchmarks/{finished_run.pk}/progress.json").status_code == 404
    assert client.get("/benchmarks/deployment/search-7b/").status_code == 404
    assert f"#{finished_run.pk}" not in client.get("/benchmarks/").content.decode()


def test_it_lists_history_per_deployment_and_per_profile(client, bob, finished_run):
    client.force_login(bob)
    by_deployment = client.get("/benchmarks/deployment/search-7b/").content.decode()
    by_profile = client.get("/benchmarks/profile/v100-7b-fp16-tp8/").content.decode()
    assert f"#{finished_run.pk}" in by_deployment and f"#{finished_run.pk}" in by_profile
    assert f"#{finished_run.pk}" not in client.get("/benchmarks/?mix=short-qa").content.decode()
    assert f"#{finished_run.pk}" in client.get("/benchmarks/?mix=fixed:16:8&state=done").content.decode()


def test_it_exports_json_with_vllm_key_names(client, bob, finished_run):
    client.force_login(bob)
    data = client.get(f"/benchmarks/{finished_run.pk}/export.json").json()
    assert data["sla_concurrency"] == 16
    assert data["levels"][1]["p95_ttft_ms"] == 3500
    assert data["run"]["snapshot"]["profile"]["name"] == "v100-7b-fp16-tp8"


def test_it_exports_csv(client, bob, finished_run):
    client.force_login(bob)
    response = client.get(f"/benchmarks/{finished_run.pk}/export.csv")
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert [row["concurrency"] for row in rows] == ["16", "32"]
    assert rows[0]["output_throughput"] == "1000"
    assert rows[0]["little_law_ok"] == "True"


def test_it_compares_two_runs_and_marks_the_deltas(client, bob, deployment, finished_run):
    other = benchmark_run_create(
        user=bob,
        run_request=BenchmarkRunRequest(
            deployment=deployment, mix="fixed:16:8", concurrencies=[16], requests_per_level=8
        ),
    )
    BenchmarkLevel.objects.create(run=other, index=0, concurrency=16, results=level(16, 1200, 700, 60))
    client.force_login(bob)
    page = client.get(f"/benchmarks/compare/?a={finished_run.pk}&b={other.pk}").content.decode()
    assert "+20.0 %" in page  # throughput 1000 → 1200
    assert '<tr class="better"><td>output tok/s</td>' in page
    assert '<tr class="better"><td>P95 TTFT ms</td>' in page  # 800 → 700 ms
    assert "(only in A)" in page  # level 32 was not run in B


def test_it_asks_for_two_runs_instead_of_a_404_when_nothing_is_picked(client, bob, finished_run):
    client.force_login(bob)
    response = client.get("/benchmarks/compare/", HTTP_REFERER="http://testserver/benchmarks/")
    assert response.status_code == 302 and response["Location"] == "http://testserver/benchmarks/"
    page = client.get(f"/benchmarks/compare/?a={finished_run.pk}", follow=True).content.decode()
    assert "pick one run as A and another as B" in page and "URLconf" not in page
    # A referer from elsewhere is not followed.
    response = client.get("/benchmarks/compare/?b=", HTTP_REFERER="https://evil.example/")
    assert response["Location"] == "/benchmarks/"
    # A run that does not exist (or is another team's) is a 404, as on every page of a run.
    assert client.get(f"/benchmarks/compare/?a={finished_run.pk}&b=999999").status_code == 404


def test_it_warns_and_marks_nothing_when_the_workloads_differ(client, bob, deployment, finished_run):
    other = benchmark_run_create(
        user=bob,
        run_request=BenchmarkRunRequest(
            deployment=deployment, mix="short-qa", concurrencies=[16], requests_per_level=8
        ),
    )
    BenchmarkLevel.objects.create(run=other, index=0, concurrency=16, results=level(16, 1700, 300, 20))
    client.force_login(bob)
    page = client.get(f"/benchmarks/compare/?a={finished_run.pk}&b={other.pk}").content.decode()
    assert "sent different workloads" in page and "+70.0 %" in page
    assert 'class="better"' not in page and 'class="worse"' not in page


def test_it_shows_what_changed_between_runs(client, alice, bob, deployment, finished_run):
    other = benchmark_run_create(
        user=bob,
        run_request=BenchmarkRunRequest(
            deployment=deployment, mix="short-qa", concurrencies=[16], requests_per_level=8
        ),
    )
    BenchmarkRun.objects.filter(pk=other.pk).update(
        snapshot={**other.snapshot, "profile": {**other.snapshot["profile"], "max_num_seqs": 64}}
    )
    client.force_login(alice)
    page = client.get(f"/benchmarks/compare/?a={finished_run.pk}&b={other.pk}").content.decode()
    assert "profile.max_num_seqs" in page
    assert "short-qa" in page


def test_it_applies_the_cap_in_one_staff_click(client, alice, bob, finished_run):
    client.force_login(bob)
    assert "apply-cap" not in client.get(finished_run.get_absolute_url()).content.decode()
    assert client.post(f"/benchmarks/{finished_run.pk}/apply-cap/").status_code == 302  # to the admin login
    finished_run.deployment.refresh_from_db()
    assert finished_run.deployment.concurrency_cap is None

    client.force_login(alice)
    assert 'id="apply-cap"' in client.get(finished_run.get_absolute_url()).content.decode()
    response = client.post(f"/benchmarks/{finished_run.pk}/apply-cap/", follow=True)
    finished_run.deployment.refresh_from_db()
    assert finished_run.deployment.concurrency_cap == 16
    page = response.content.decode()
    assert f"benchmark run {finished_run.pk}" in page  # the deployment page says where the cap came from


def test_it_cancels_from_the_page(client, bob, deployment):
    run = benchmark_run_create(
        user=bob, run_request=BenchmarkRunRequest(deployment=deployment, concurrencies=[4])
    )
    client.force_login(bob)
    client.post(f"/benchmarks/{run.pk}/cancel/")
    run.refresh_from_db()
    assert run.state == RunState.CANCELLED


def test_it_starts_a_run_from_the_form(client, bob, deployment):
    client.force_login(bob)
    response = client.post(
        "/benchmarks/new/",
        {
            "deployment": "search-7b",
            "mix": "short-qa",
            "concurrencies": "4,8",
            "requests_per_level": 16,
            "seed": 1,
        },
    )
    run = BenchmarkRun.objects.get()
    assert response.status_code == 302 and response["Location"] == run.get_absolute_url()
    assert [lv["concurrency"] for lv in run.config["levels"]] == [4, 8]


def test_it_names_the_mix_error_on_the_form(client, bob, deployment):
    client.force_login(bob)
    page = client.post(
        "/benchmarks/new/", {"deployment": "search-7b", "mix": "field_mix", "concurrencies": "4", "seed": 0}
    ).content.decode()
    assert "unknown mix" in page and "field-mix" in page
    assert not BenchmarkRun.objects.exists()


def test_it_imports_the_field_notes_table_and_shows_why_it_fails(client, alice):
    client.force_login(alice)
    assert "1380" in client.get("/benchmarks/import/").content.decode()  # prefilled
    response = client.post(
        "/benchmarks/import/", {"title": "V100 field guide 7B", "table": FIELD_GUIDE_7B_TABLE}, follow=True
    )
    page = response.content.decode()
    assert "suspected measurement problem" in page
    assert "can emit at most ~381 tok/s, yet 1380 tok/s is reported" in page
    assert "Concurrency 64" in page


def test_it_keeps_imports_to_staff(client, bob):
    client.force_login(bob)
    assert client.get("/benchmarks/import/").status_code == 302


def test_it_shows_imported_runs_without_a_deployment_to_staff_only(client, alice, bob):
    run = benchmark_import_table(user=alice, title="x", text=FIELD_GUIDE_7B_TABLE)
    client.force_login(bob)
    assert client.get(run.get_absolute_url()).status_code == 404


def test_it_links_benchmarks_from_the_deployment_page(client, bob, deployment):
    client.force_login(bob)
    assert "/benchmarks/deployment/search-7b/" in client.get(deployment.get_absolute_url()).content.decode()


def test_it_keeps_where_engines_live_to_staff_in_every_text_of_a_run(client, alice, bob, deployment):
    from portal.inventory.models import Node
    from tests.helpers.clients import api_client

    Node.objects.filter(pk=deployment.node_id).update(hostname="gpu-rack7")
    run = benchmark_run_create(
        user=alice,
        run_request=BenchmarkRunRequest(
            deployment=deployment, mix="fixed:16:8", concurrencies=[16], requests_per_level=8
        ),
    )
    config = {**run.config, "tokenizer": "/srv/models/llama-2-7b/tokenizer.json"}
    BenchmarkRun.objects.filter(pk=run.pk).update(
        state=RunState.PARTIAL,
        state_reason="level 1 stopped early: cannot reach http://10.20.0.7:8001/v1/models: refused",
        prompt_source="/srv/models/llama-2-7b/tokenizer.json",
        config=config,
    )
    failing = {
        **level(16, 1000, 800, 60),
        "failed": 3,
        "errors": {
            "connection error (ClientConnectorError): Cannot connect to host 10.20.0.7:8001 ssl:default": 2,
            "HTTP 500: gpu-rack7 failed reading /var/lib/portal/run/12/server.log": 1,
        },
        "metrics_error": "ClientConnectorError: Cannot connect to host gpu-rack7.lab.example:8001",
        "partial": True,
        "partial_reason": "level timeout after 600 s",
    }
    failing["errors"]["upstream 10.20.0.8 closed the stream"] = 1
    BenchmarkLevel.objects.create(run=run, index=0, concurrency=16, results=failing)
    secrets = ("10.20.0.7", "10.20.0.8", ":8001", "gpu-rack7", "/srv/models", "/var/lib/portal")

    client.force_login(bob)
    shown = [
        client.get(run.get_absolute_url()).content.decode(),
        client.get(f"/benchmarks/{run.pk}/progress.json").content.decode(),
        client.get(f"/benchmarks/{run.pk}/export.json").content.decode(),
        client.get(f"/benchmarks/{run.pk}/export.csv").content.decode(),
        api_client(bob).get(f"/api/v1/benchmark-runs/{run.pk}/").content.decode(),
        api_client(bob).get("/api/v1/benchmark-runs/").content.decode(),
    ]
    for text in shown:
        for secret in secrets:
            assert secret not in text, (secret, text[:2000])
    page = shown[0]
    assert "2 × connection error (ClientConnectorError): Cannot connect to host &lt;server&gt;" in page
    assert "level timeout after 600 s" in page  # what is not an address stays as it was
    assert "cannot reach &lt;server&gt;: refused" in page

    client.force_login(alice)
    staff_page = client.get(run.get_absolute_url()).content.decode()
    assert "10.20.0.7:8001" in staff_page and "/srv/models/llama-2-7b/tokenizer.json" in staff_page


@pytest.mark.parametrize(
    "text",
    [
        "mix fixed:16:8 at 32 users",
        "1380 tok/s, P95 TTFT 0.82 s",
        "HTTP 429 daily_budget_exceeded: The daily token budget is spent; requests resume at 00:00 UTC.",
        "level 2 stopped early: level timeout after 600 s",
    ],
)
def test_it_leaves_texts_without_an_address_as_they_are(text):
    from portal.benchmarks.selectors import redact_text

    assert redact_text(text, []) == text


def test_it_lists_a_run_of_an_adopted_deployment_without_a_profile(client, bob, team, llama7b, fake_server):
    from tests.helpers.builders import serving_deployment

    adopted = serving_deployment(
        name="adopted-7b", team=team, model_version=llama7b, endpoint_url=fake_server.url, adopted=True
    )
    benchmark_run_create(
        user=bob,
        run_request=BenchmarkRunRequest(deployment=adopted, mix="fixed:16:8", concurrencies=[2]),
    )
    client.force_login(bob)
    response = client.get("/benchmarks/")
    assert response.status_code == 200
    assert "adopted-7b" in response.content.decode()


def test_it_reads_levels_separated_by_spaces_as_separate_levels(client, bob, deployment):
    client.force_login(bob)
    data = {"deployment": "search-7b", "mix": "short-qa", "concurrencies": "4 8  16", "seed": 1}
    client.post("/benchmarks/new/", {**data, "requests_per_level": 16})
    run = BenchmarkRun.objects.get()
    assert [lv["concurrency"] for lv in run.config["levels"]] == [4, 8, 16]


def test_a_queued_run_says_it_waits_for_the_benchmarks_worker(client, bob, deployment):
    run = benchmark_run_create(
        user=bob, run_request=BenchmarkRunRequest(deployment=deployment, concurrencies=[4])
    )
    client.force_login(bob)
    page = client.get(run.get_absolute_url()).content.decode()
    assert "Waiting for the benchmarks worker" in page
    assert "control worker" not in page


def test_it_leaves_acceptance_reference_deployments_and_profiles_out_of_the_filters(client, alice, dgx, team):
    from portal.inventory.models import ACCEPTANCE_SOURCE_PREFIX
    from tests.helpers import builders

    version = builders.model_version("accept-tiny-fp16", source=f"{ACCEPTANCE_SOURCE_PREFIX} (tiny)")
    profile = builders.profile(version, name="accept-dgx-v100-01-1")
    builders.deployment(
        name="accept-dgx-v100-01-1", team=team, model_version=version, profile=profile, node=dgx
    )
    client.force_login(alice)
    context = client.get("/benchmarks/").context
    assert "accept-dgx-v100-01-1" not in [d.name for d in context["deployments"]]
    assert "accept-dgx-v100-01-1" not in [p.name for p in context["profiles"]]
