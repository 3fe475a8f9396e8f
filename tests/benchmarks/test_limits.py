"""What a benchmark run may ask: bounds for everyone, tighter ones for members, one active run per
user, and a member's load within a shared deployment's gateway cap."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from portal.benchmarks.models import BenchmarkRun, RunState
from portal.benchmarks.services import BenchmarkRunRequest, benchmark_run_cancel, benchmark_run_create, runs
from portal.core.errors import ApplicationError
from portal.deployments.models import Deployment
from tests.helpers.clients import api_client

pytestmark = pytest.mark.django_db


def start(user, **body):
    return api_client(user).post(
        "/api/v1/benchmark-runs/",
        {"deployment": "search-7b", "mix": "fixed:16:8", "concurrencies": [2], "requests_per_level": 4}
        | body,
        format="json",
    )


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"concurrencies": [2, 65]}, "concurrencies"),
        ({"concurrencies": list(range(1, 10))}, "concurrencies"),
        ({"concurrencies": [], "request_rates": [16.5]}, "request_rates"),
        ({"requests_per_level": 1001}, "requests_per_level"),
        ({"requests_per_level": None, "duration_s": 601}, "duration_s"),
        ({"level_timeout_s": 601}, "level_timeout_s"),
    ],
)
def test_it_refuses_a_member_more_than_the_member_bounds_with_a_400_naming_the_field(
    bob, deployment, body, field
):
    response = start(bob, **body)
    assert response.status_code == 400, response.json()
    assert field in response.json()
    assert "non-staff" in response.json()[field][0]
    assert not BenchmarkRun.objects.exists()


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"concurrencies": [5000]}, "concurrencies"),
        ({"concurrencies": list(range(1, 18))}, "concurrencies"),
        ({"concurrencies": [], "request_rates": [20000]}, "request_rates"),
        ({"requests_per_level": 100_001}, "requests_per_level"),
        ({"requests_per_level": None, "duration_s": 90_000}, "duration_s"),
        ({"level_timeout_s": 90_000}, "level_timeout_s"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**40}, "seed"),
        ({"mix": "x" * 5000}, "mix"),
    ],
)
def test_it_bounds_what_even_staff_may_ask(alice, deployment, body, field):
    response = start(alice, **body)
    assert response.status_code == 400, response.json()
    assert field in response.json()


def test_it_lets_staff_ask_past_the_member_bounds(alice, deployment):
    response = start(alice, concurrencies=[128], requests_per_level=5000)
    assert response.status_code == 201, response.json()


def test_it_ends_every_level_of_a_members_run(bob, alice, deployment, settings):
    settings.BENCHMARK_MEMBER_MAX_LEVEL_S = 300.0
    member_run = benchmark_run_create(
        user=bob, run_request=BenchmarkRunRequest(deployment=deployment, mix="fixed:16:8", concurrencies=[2])
    )
    assert member_run.config["level_timeout_s"] == 300.0  # none asked: the longest a member's level runs
    staff_run = benchmark_run_create(
        user=alice,
        run_request=BenchmarkRunRequest(deployment=deployment, mix="fixed:16:8", concurrencies=[2]),
    )
    assert staff_run.config["level_timeout_s"] is None


def test_it_reads_the_member_bounds_from_settings(bob, deployment, settings):
    settings.BENCHMARK_MEMBER_MAX_CONCURRENCY = 4
    assert start(bob, concurrencies=[5]).status_code == 400
    assert start(bob, concurrencies=[4]).status_code == 201


def test_it_gives_a_user_one_run_at_a_time(bob, deployment):
    first = start(bob)
    assert first.status_code == 201
    second = start(bob)
    assert second.status_code == 400
    assert "one run at a time" in second.json()["non_field_errors"][0]
    assert second.json()["active_run"] == str(first.json()["id"])
    benchmark_run_cancel(run=BenchmarkRun.objects.get(pk=first.json()["id"]))
    assert start(bob).status_code == 201


def test_it_counts_a_running_run_only_while_its_lease_lives(bob, deployment):
    run_id = start(bob).json()["id"]
    BenchmarkRun.objects.filter(pk=run_id).update(
        state=RunState.RUNNING, lease_expires_at=timezone.now() + timedelta(minutes=1)
    )
    assert start(bob).status_code == 400
    # Its worker died: the run no longer holds the user back (a redelivery may still resume it).
    BenchmarkRun.objects.filter(pk=run_id).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    assert start(bob).status_code == 201


def test_it_counts_runs_per_user_not_per_team(bob, charlie, team, deployment):
    team.members.add(charlie)
    assert start(bob).status_code == 201
    assert start(charlie).status_code == 201


def test_it_refuses_staff_a_second_run_too(alice, deployment):
    assert start(alice).status_code == 201
    assert start(alice).status_code == 400


def _waiting_on_a_lock() -> bool:
    with connection.cursor() as cursor:
        # Inside a transaction PostgreSQL keeps the first pg_stat_activity it read: drop that
        # snapshot, or a request that starts waiting after the first look is never seen.
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock'"
        )
        return cursor.fetchone()[0] > 0


@pytest.mark.django_db(transaction=True)
def test_it_starts_only_one_of_two_simultaneous_requests(bob, deployment, monkeypatch):
    """The first request holds its transaction open until the second has checked too or waits on
    the lock: without the lock both would find no active run and both would start."""
    real = runs._active_run
    checked: list[str] = []
    guard = threading.Lock()
    second_checked = threading.Event()

    def spy(user):
        found = real(user)
        with guard:
            checked.append(threading.current_thread().name)
            first = len(checked) == 1
        if not first:
            second_checked.set()
            return found
        deadline = time.monotonic() + 20
        while not second_checked.is_set() and not _waiting_on_a_lock():
            assert time.monotonic() < deadline, "the second request neither checked nor waited"
            time.sleep(0.01)
        return found

    monkeypatch.setattr(runs, "_active_run", spy)
    outcomes: dict[str, object] = {}

    def request(name: str) -> None:
        try:
            outcomes[name] = benchmark_run_create(
                user=bob,
                run_request=BenchmarkRunRequest(deployment=deployment, mix="fixed:16:8", concurrencies=[2]),
            )
        except ApplicationError as error:
            outcomes[name] = error
        finally:
            connection.close()

    threads = [threading.Thread(target=request, args=(name,), name=name) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert BenchmarkRun.objects.count() == 1
    refused = [o for o in outcomes.values() if isinstance(o, ApplicationError)]
    assert len(refused) == 1 and "one run at a time" in refused[0].message


def test_it_keeps_a_members_load_on_a_shared_deployment_within_its_cap(bob, alice, deployment):
    Deployment.objects.filter(pk=deployment.pk).update(shared=True, concurrency_cap=4)
    above = start(bob, concurrencies=[2, 8])
    assert above.status_code == 400
    assert "gateway cap is 4" in above.json()["concurrencies"][0]
    open_loop = start(bob, concurrencies=[], request_rates=[1])
    assert open_loop.status_code == 400
    assert "request_rates" in open_loop.json()
    assert start(bob, concurrencies=[2, 4]).status_code == 201
    # Staff measure above the cap: that is how the next cap is found.
    assert start(alice, concurrencies=[8]).status_code == 201


def test_it_leaves_the_cap_of_an_unshared_deployment_to_its_own_team(bob, deployment):
    Deployment.objects.filter(pk=deployment.pk).update(shared=False, concurrency_cap=4)
    assert start(bob, concurrencies=[8]).status_code == 201


def test_it_says_on_the_form_which_run_is_still_active(client, bob, deployment):
    first = start(bob).json()["id"]
    client.force_login(bob)
    page = client.post(
        "/benchmarks/new/",
        {"deployment": "search-7b", "mix": "fixed:16:8", "concurrencies": "2", "requests_per_level": 4,
         "seed": 0},
    )  # fmt: skip
    assert page.status_code == 200
    assert f"you already have benchmark run {first} queued" in page.content.decode()
    assert BenchmarkRun.objects.count() == 1
