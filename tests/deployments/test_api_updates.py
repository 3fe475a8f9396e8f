"""A deployment is never updated in place: the API refuses PUT and PATCH, as documented."""

from __future__ import annotations

import pytest

from tests.helpers.builders import make_deployment
from tests.helpers.clients import api_client

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("method", ["put", "patch"])
def test_it_refuses_to_update_a_deployment_in_place(
    alice, team, tiny_version, tiny_profile, fake_node, method
):
    deployment = make_deployment(team, tiny_version, tiny_profile, fake_node)
    response = getattr(api_client(alice), method)(
        f"/api/v1/deployments/{deployment.name}/", {"concurrency_cap": 4}, format="json"
    )
    assert response.status_code == 405
    deployment.refresh_from_db()
    assert deployment.concurrency_cap is None
