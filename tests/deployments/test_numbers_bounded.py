"""A deployment's and a profile's numbers are bounded on save: a form (admin) names the field, and
the database refuses what skips the form. `restart_after_hours=0` once restarted the server on
every supervision tick."""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction

from portal.deployments.models import Deployment, DeploymentProfile
from tests.helpers import builders

pytestmark = pytest.mark.django_db


@pytest.fixture
def deployment(team, llama7b, profile_tp1, dgx):
    return builders.deployment(
        name="d1", team=team, model_version=llama7b, profile=profile_tp1, node=dgx, desired_state="stopped"
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("restart_after_hours", 0),
        ("restart_after_hours", -1),
        ("restart_after_hours", 1e9),
        ("restart_max_preemptions", 0),
        ("restart_max_memory_growth", 0),
        ("restart_max_memory_growth", 1e6),
        ("sla_p95_ttft_s", 0),
        ("sla_p95_tpot_s", 1e6),
    ],
)
def test_a_deployment_number_that_would_turn_a_limit_off_is_refused_naming_it(deployment, field, value):
    setattr(deployment, field, value)
    with pytest.raises(ValidationError) as refused:
        deployment.full_clean()
    assert field in refused.value.message_dict
    with pytest.raises(IntegrityError), transaction.atomic():
        Deployment.objects.filter(pk=deployment.pk).update(**{field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_num_seqs", 0), ("max_model_len", 0), ("max_num_batched_tokens", 0), ("swap_space_gb", -1)],
)
def test_a_profile_number_out_of_bounds_is_refused_naming_it(profile_tp1, field, value):
    setattr(profile_tp1, field, value)
    with pytest.raises(ValidationError) as refused:
        profile_tp1.full_clean()
    assert field in refused.value.message_dict
    with pytest.raises(IntegrityError), transaction.atomic():
        DeploymentProfile.objects.filter(pk=profile_tp1.pk).update(**{field: value})


def test_sensible_restart_settings_still_save(deployment):
    deployment.restart_after_hours, deployment.restart_max_preemptions = 0.5, 10
    deployment.full_clean()
    deployment.save()
