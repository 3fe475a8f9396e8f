"""deploy/: the Prometheus alert rules and the Grafana dashboard name only metrics the portal exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from portal.deployments.models import Deployment
from portal.observability.models import SlaBreach
from tests.helpers import builders
from tests.helpers.metrics import TOKEN

pytestmark = pytest.mark.django_db
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
ALERTS = DEPLOY / "prometheus" / "portal-alerts.yml"
DASHBOARD = DEPLOY / "grafana" / "portal-dashboard.json"
# Every metric of the portal starts with portal_ (Prometheus' own, e.g. `up`, are not used).
PORTAL_NAME = re.compile(r"\bportal_[a-z0-9_]+\b")
SUFFIXES = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}


def alert_exprs() -> list[str]:
    rules = [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]
    assert rules and all({"alert", "expr", "labels", "annotations"} <= set(rule) for rule in rules)
    return [rule["expr"] for rule in rules]


def dashboard_exprs() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    exprs = [target["expr"] for panel in panels for target in panel["targets"]]
    assert len(exprs) >= len(panels) > 0
    return exprs


def exported_names(client) -> set[str]:
    """Every sample name /metrics can show: each family it announces, under its type's suffixes."""
    response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code == 200
    names = set()
    for family in text_string_to_metric_families(response.content.decode()):
        names.update(family.name + suffix for suffix in SUFFIXES[family.type])
    return names


@pytest.fixture
def scrape_world(settings, metrics_redis, team, llama7b, cpu_node):
    settings.PORTAL_METRICS_TOKEN = TOKEN
    deployment = builders.deployment(
        name="chat", team=team, model_version=llama7b, node=cpu_node, state="serving"
    )
    SlaBreach.objects.create(deployment=deployment, started_at="2026-11-30T12:00:00Z", reason="P95 TTFT")


@pytest.mark.parametrize("source", ["alerts", "dashboard"])
def test_every_metric_the_deploy_files_name_is_one_the_portal_exports(client, scrape_world, source):
    exprs = alert_exprs() if source == "alerts" else dashboard_exprs()
    named = {name for expr in exprs for name in PORTAL_NAME.findall(expr)}
    exported = exported_names(client)
    assert "portal_deployment_sla_breaching" in named
    assert named - exported == set(), f"named in deploy/ but not exported: {sorted(named - exported)}"


def test_the_breaching_gauge_is_one_for_a_deployment_with_an_open_breach_only(client, scrape_world):
    from tests.helpers.metrics import scrape, value

    builders.deployment(
        name="calm", team=Deployment.objects.get().team, model_version=Deployment.objects.get().model_version
    )
    samples = scrape(client)
    assert value(samples, "portal_deployment_sla_breaching", deployment="chat") == 1
    assert ("portal_deployment_sla_breaching", (("deployment", "calm"),)) in samples
    assert value(samples, "portal_deployment_sla_breaching", deployment="calm") == 0
    SlaBreach.objects.update(ended_at="2026-11-30T12:10:00Z")
    assert value(scrape(client), "portal_deployment_sla_breaching", deployment="chat") == 0
