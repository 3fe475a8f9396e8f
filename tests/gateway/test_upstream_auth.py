"""The gateway authenticates to each replica with that server's own key, never the client's."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers.gateway import chat_body, upstream_stats

pytestmark = [pytest.mark.django_db(transaction=True)]


@pytest.mark.parametrize("stream", [True, False])
def test_it_sends_the_replicas_server_key_upstream_and_not_the_clients(gateway, serving, stream):
    from portal.deployments.models import Deployment

    Deployment.objects.filter(pk=serving.deployment.pk).update(engine_api_key="server-key-123")
    response = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        headers=serving.headers,
        json=chat_body(serving.model, stream=stream, max_tokens=2),
    )
    assert response.status_code == 200
    assert upstream_stats(serving.upstream)["last_authorization"] == "Bearer server-key-123"
    assert serving.token not in gateway.log_text()
    assert "server-key-123" not in gateway.log_text()


def test_it_sends_no_authorization_to_a_replica_without_a_key(gateway, serving):
    response = httpx.post(
        f"{gateway.url}/v1/completions",
        headers=serving.headers,
        json={"model": serving.model, "prompt": "Once upon", "max_tokens": 2},
    )
    assert response.status_code == 200
    assert upstream_stats(serving.upstream)["last_authorization"] is None
