"""The job runner (portal/core/jobs): a claim, a lease renewed while working, a fencing token that
every write checks. Run here on a deployment's row (any LeasedJob row behaves the same); each job
kind's own takeover is tested beside it (deployments, registry, benchmarks, acceptance)."""

from __future__ import annotations

import logging

import pytest
from django.db.models import Q
from django.utils import timezone

from portal.core.jobs import LostLease, claim, lease_break
from portal.deployments.models import Deployment, DeploymentEvent
from tests.helpers.builders import make_serving_deployment

pytestmark = pytest.mark.django_db


@pytest.fixture
def row(team, llama7b, profile_tp8, dgx):
    return make_serving_deployment(team=team, model=llama7b, profile=profile_tp8, node=dgx, url="http://x")


def _lapse(row) -> None:
    lapsed = timezone.now() - timezone.timedelta(seconds=1)
    Deployment.objects.filter(pk=row.pk).update(lease_expires_at=lapsed)


def test_it_claims_a_free_job_and_a_duplicate_message_is_a_no_op_while_the_lease_is_live(row):
    lease = claim(Deployment, row.pk, worker="worker-a", ttl_s=60)
    assert lease is not None and lease.token == 1
    assert claim(Deployment, row.pk, worker="worker-b", ttl_s=60) is None
    row.refresh_from_db()
    assert row.lease_owner == "worker-a" and row.lease_token == 1


def test_it_takes_over_a_lapsed_lease_with_the_next_token(row):
    first = claim(Deployment, row.pk, worker="worker-a", ttl_s=60)
    _lapse(row)
    second = claim(Deployment, row.pk, worker="worker-b", ttl_s=60)
    assert second is not None and second.token == first.token + 1
    row.refresh_from_db()
    assert row.lease_owner == "worker-b" and row.lease_expires_at > timezone.now()


def test_it_claims_only_what_the_kind_calls_claimable(row):
    assert claim(Deployment, row.pk, worker="worker-a", ttl_s=60, claimable=Q(state="stopped")) is None
    assert claim(Deployment, row.pk, worker="worker-a", ttl_s=60, claimable=Q(state="serving")) is not None


def test_a_lost_lease_writes_nothing_in_its_fenced_transaction(row):
    stale = claim(Deployment, row.pk, worker="worker-a", ttl_s=60)
    _lapse(row)
    fresh = claim(Deployment, row.pk, worker="worker-b", ttl_s=60)
    with pytest.raises(LostLease), stale.fenced():
        DeploymentEvent.objects.create(deployment_id=row.pk, step="stale", status="ok")
    with pytest.raises(LostLease):
        stale.write(state_reason="the stale worker's")
    with fresh.fenced() as locked:
        assert locked.lease_token == fresh.token
        DeploymentEvent.objects.create(deployment_id=row.pk, step="fresh", status="ok")
    fresh.write(state_reason="the fresh worker's")
    row.refresh_from_db()
    assert row.state_reason == "the fresh worker's"
    assert list(row.events.filter(step__in=["stale", "fresh"]).values_list("step", flat=True)) == ["fresh"]


def test_an_error_inside_the_fence_rolls_its_writes_back(row):
    lease = claim(Deployment, row.pk, worker="worker-a", ttl_s=60)
    with pytest.raises(RuntimeError), lease.fenced():
        DeploymentEvent.objects.create(deployment_id=row.pk, step="half", status="ok")
        raise RuntimeError("disk full")
    assert not row.events.filter(step="half").exists()


def test_a_failed_renewal_is_logged_and_raised(row, caplog):
    lease = claim(Deployment, row.pk, worker="worker-a", ttl_s=60)
    lease.renew()  # still ours: fine
    _lapse(row)
    claim(Deployment, row.pk, worker="worker-b", ttl_s=60)
    with caplog.at_level(logging.WARNING, logger="portal.core.jobs.lease"), pytest.raises(LostLease):
        lease.renew()
    assert f"renewal refused, lease {lease.token} lost" in caplog.text


def test_breaking_a_lease_fences_its_holder_out_and_finish_lets_it_go(row):
    lease = claim(Deployment, row.pk, worker="worker-a", ttl_s=60)
    assert lease_break(Deployment.objects.filter(pk=row.pk), state_reason="ended by a sweep") == 1
    with pytest.raises(LostLease):
        lease.finish(state_reason="the holder's")
    again = claim(Deployment, row.pk, worker="worker-b", ttl_s=60)
    assert again.token == lease.token + 2  # one for the break, one for the claim
    again.finish(state_reason="done")
    row.refresh_from_db()
    assert (row.state_reason, row.lease_owner, row.lease_expires_at) == ("done", "", None)
    assert row.lease_token == again.token  # it only grows
