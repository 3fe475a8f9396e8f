"""A task about a row that does not exist logs one line and ends quietly (no DoesNotExist traceback)."""

from __future__ import annotations

import logging

import pytest

from portal.benchmarks.tasks import run_benchmark
from portal.core.tasking import skip_missing_row
from portal.deployments.models import Deployment
from portal.deployments.tasks import (
    check_adopted,
    restart_deployment,
    start_deployment,
    stop_deployment,
)
from portal.inventory.tasks import discover_gpus, probe_software
from portal.registry.tasks import convert_model_version, hash_model_version
from tests.helpers import builders

pytestmark = pytest.mark.django_db

MISSING_ID = 987_654_321

TASKS_WITH_A_MISSING_ROW = [
    (start_deployment, MISSING_ID),
    (stop_deployment, MISSING_ID),
    (restart_deployment, MISSING_ID),
    (check_adopted, MISSING_ID),
    (run_benchmark, MISSING_ID),
    (convert_model_version, MISSING_ID),
    (hash_model_version, MISSING_ID),
    (discover_gpus, "no-such-node"),
    (probe_software, "no-such-node"),
]


@pytest.mark.parametrize(
    ("task", "missing"), TASKS_WITH_A_MISSING_ROW, ids=[t.name for t, _ in TASKS_WITH_A_MISSING_ROW]
)
def test_it_logs_one_line_and_ends_quietly_for_a_row_this_database_never_had(task, missing, caplog):
    with caplog.at_level(logging.WARNING):
        result = task.apply(args=[missing])
    assert result.successful(), result.traceback
    assert result.result is None
    lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1
    assert lines[0].name == "portal.tasks" and str(missing) in lines[0].getMessage()
    assert lines[0].exc_info is None


def test_it_ends_quietly_when_the_row_is_deleted_while_the_task_runs(team, llama7b, profile_tp1, cpu_node):
    deployment = builders.deployment(
        name="short-lived", team=team, model_version=llama7b, profile=profile_tp1, node=cpu_node
    )

    @skip_missing_row("deployments.Deployment", arg="deployment_id")
    def work(deployment_id: int) -> str:
        Deployment.objects.filter(pk=deployment_id).delete()
        return Deployment.objects.get(pk=deployment_id).name

    assert work(deployment.pk) is None


def test_it_still_raises_when_the_row_exists(team, llama7b, profile_tp1, cpu_node):
    deployment = builders.deployment(
        name="still-here", team=team, model_version=llama7b, profile=profile_tp1, node=cpu_node
    )

    @skip_missing_row("deployments.Deployment", arg="deployment_id")
    def work(deployment_id: int) -> str:
        return Deployment.objects.get(pk=deployment_id, name="another").name

    with pytest.raises(Deployment.DoesNotExist):
        work(deployment.pk)
