"""The node page's *Discover GPUs* and *Probe engine* buttons ask the node's agent, as the API does."""

from __future__ import annotations

import pytest

from portal.audit.models import AuditEvent

pytestmark = pytest.mark.django_db


def test_the_node_page_offers_staff_a_discover_and_a_probe_engine_button(client, alice, dgx):
    client.force_login(alice)
    page = client.get(f"/nodes/{dgx.name}/").content.decode()
    assert f'action="/nodes/{dgx.name}/ask/discover/"' in page and ">Discover GPUs</button>" in page
    assert f'action="/nodes/{dgx.name}/ask/probe-engine/"' in page and ">Probe engine</button>" in page


@pytest.mark.parametrize(
    ("what", "action"), [("discover", "node.discover"), ("probe-engine", "node.probe_software")]
)
def test_a_button_sends_its_request_to_the_nodes_agent_and_audits_it(client, alice, dgx, what, action):
    client.force_login(alice)
    response = client.post(f"/nodes/{dgx.name}/ask/{what}/")
    assert response.status_code == 302 and response["Location"] == f"/nodes/{dgx.name}/"
    event = AuditEvent.objects.get(action=action)
    assert event.changes["task_id"]


def test_members_get_no_buttons_and_cannot_post(client, bob, dgx):
    client.force_login(bob)
    assert "ask/discover/" not in client.get(f"/nodes/{dgx.name}/").content.decode()
    assert client.post(f"/nodes/{dgx.name}/ask/discover/").status_code == 403
