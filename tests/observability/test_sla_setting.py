"""A deployment's SLA: set through the API (staff), bounded, audited, and used to judge breaches."""

from __future__ import annotations

import pytest

from portal.audit.models import AuditEvent
from tests.helpers import builders
from tests.helpers.clients import api_client

pytestmark = pytest.mark.django_db


@pytest.fixture
def chat(team, llama7b, cpu_node):
    return builders.deployment(name="chat", team=team, model_version=llama7b, node=cpu_node)


def test_staff_set_a_deployments_sla_and_the_api_shows_it(alice, chat):
    response = api_client(alice).post(
        "/api/v1/deployments/chat/sla/", {"p95_ttft_s": 1.5, "p95_tpot_s": 0.08}, format="json"
    )
    assert response.status_code == 200, response.content
    assert (response.json()["sla_p95_ttft_s"], response.json()["sla_p95_tpot_s"]) == (1.5, 0.08)
    chat.refresh_from_db()
    assert (chat.sla_p95_ttft_s, chat.sla_p95_tpot_s) == (1.5, 0.08)
    event = AuditEvent.objects.get(action="deployment.set_sla")
    assert event.changes["sla_p95_ttft_s"] == [3.0, 1.5]
    assert api_client(alice).get("/api/v1/deployments/chat/").json()["sla_p95_tpot_s"] == 0.08


@pytest.mark.parametrize(
    "body, field",
    [
        ({"p95_ttft_s": 0, "p95_tpot_s": 0.2}, "p95_ttft_s"),
        ({"p95_ttft_s": 601, "p95_tpot_s": 0.2}, "p95_ttft_s"),
        ({"p95_ttft_s": 3, "p95_tpot_s": 61}, "p95_tpot_s"),
        ({"p95_ttft_s": 3, "p95_tpot_s": "fast"}, "p95_tpot_s"),
        ({"p95_ttft_s": 3}, "p95_tpot_s"),
    ],
)
def test_an_sla_out_of_bounds_is_a_400_naming_the_field(alice, chat, body, field):
    response = api_client(alice).post("/api/v1/deployments/chat/sla/", body, format="json")
    assert response.status_code == 400
    assert field in response.content.decode()
    chat.refresh_from_db()
    assert (chat.sla_p95_ttft_s, chat.sla_p95_tpot_s) == (3.0, 0.2)


def test_a_team_member_cannot_change_the_sla(bob, chat):
    response = api_client(bob).post(
        "/api/v1/deployments/chat/sla/", {"p95_ttft_s": 30, "p95_tpot_s": 1}, format="json"
    )
    assert response.status_code == 403
    chat.refresh_from_db()
    assert chat.sla_p95_ttft_s == 3.0


def test_the_admin_forms_offer_the_sla(admin_client, chat):
    for url in ("/admin/deployments/deployment/add/", f"/admin/deployments/deployment/{chat.pk}/change/"):
        page = admin_client.get(url).content.decode()
        assert 'name="sla_p95_ttft_s"' in page and 'name="sla_p95_tpot_s"' in page


def test_the_admin_lists_breaches_read_only(admin_client, chat):
    from portal.observability.models import SlaBreach

    reason = "P95 TTFT 4.00 s > 3 s"
    SlaBreach.objects.create(deployment=chat, started_at="2026-11-30T12:00:00Z", reason=reason)
    page = admin_client.get("/admin/observability/slabreach/").content.decode()
    assert "P95 TTFT 4.00 s &gt; 3 s" in page
    assert admin_client.get("/admin/observability/slabreach/add/").status_code == 403
