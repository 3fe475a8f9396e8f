"""Lifecycle requests over the API, the pages and the commands; adopted endpoints."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.core.management import CommandError, call_command
from django.urls import reverse

from portal.deployments.agent.adopted import adopted_check
from portal.deployments.agent.start import deployment_start
from portal.deployments.agent.supervise import deployment_supervise
from portal.deployments.models import Deployment, DeploymentEvent, MetricsSample
from portal.deployments.services import endpoint_url_from
from tests.helpers import builders
from tests.helpers.builders import make_deployment
from tests.helpers.clients import api_client

pytestmark = pytest.mark.django_db


@pytest.fixture
def deployment(team, tiny_version, tiny_profile, fake_node):
    return make_deployment(team, tiny_version, tiny_profile, fake_node)


def test_it_queues_the_start_on_the_nodes_queue_when_a_deployment_is_created(
    alice, team, tiny_version, tiny_profile, fake_node, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks() as callbacks:
        response = api_client(alice).post(
            "/api/v1/deployments/",
            {
                "name": "tiny",
                "team": "search",
                "model_version": "tiny-llama",
                "profile": "cpu-tiny",
                "node": "fake-node",
                "gpu_indices": [],
            },
            format="json",
        )
    assert response.status_code == 201, response.json()
    assert response.json()["state"] == "pending"
    assert len(callbacks) == 1
    deployment = Deployment.objects.get(name="tiny")
    assert deployment.start_requested_at is not None
    assert deployment.events.get(step="created")


def test_it_lets_staff_stop_and_start_over_the_api(alice, deployment, django_capture_on_commit_callbacks):
    client = api_client(alice)
    with django_capture_on_commit_callbacks() as callbacks:
        stop = client.post(f"/api/v1/deployments/{deployment.name}/stop/")
    assert stop.status_code == 202 and stop.json()["desired_state"] == "stopped"
    assert len(callbacks) == 1
    with django_capture_on_commit_callbacks() as callbacks:
        start = client.post(f"/api/v1/deployments/{deployment.name}/start/")
    assert start.status_code == 202
    assert start.json()["desired_state"] == "running" and start.json()["state"] == "pending"
    assert len(callbacks) == 1


def test_it_refuses_to_restart_a_stopped_deployment(alice, deployment):
    Deployment.objects.filter(pk=deployment.pk).update(desired_state="stopped")
    response = api_client(alice).post(f"/api/v1/deployments/{deployment.name}/restart/")
    assert response.status_code == 400
    assert "start it instead" in response.json()["desired_state"][0]


def test_it_checks_the_quota_again_when_a_stopped_deployment_starts(
    alice, bob, team, dgx, llama7b, profile_tp1
):
    first = make_deployment(team, llama7b, profile_tp1, dgx, name="first", gpus=[0], desired_state="stopped")
    team.gpu_quota = 1
    team.save()
    make_deployment(team, llama7b, profile_tp1, dgx, name="second", gpus=[1])
    response = api_client(alice).post(f"/api/v1/deployments/{first.name}/start/")
    assert response.status_code == 400
    assert "holds 1 of its 1 GPUs" in response.json()["team"][0]


def test_it_lets_members_read_but_not_act_and_hides_from_other_teams(bob, charlie, deployment):
    assert api_client(bob).post(f"/api/v1/deployments/{deployment.name}/stop/").status_code == 403
    assert api_client(bob).get(f"/api/v1/deployments/{deployment.name}/timeline/").status_code == 200
    assert api_client(charlie).get(f"/api/v1/deployments/{deployment.name}/timeline/").status_code == 404
    assert api_client(charlie).get(f"/api/v1/deployments/{deployment.name}/samples/").status_code == 404


def test_it_refuses_to_delete_a_deployment_that_may_still_run(alice, deployment):
    response = api_client(alice).delete(f"/api/v1/deployments/{deployment.name}/")
    assert response.status_code == 400
    assert Deployment.objects.filter(pk=deployment.pk).exists()


def test_it_serves_the_timeline_and_samples_as_json(bob, deployment):
    MetricsSample.objects.create(deployment=deployment, healthy=True, running=3, kv_cache_usage=0.5)
    timeline = api_client(bob).get(f"/api/v1/deployments/{deployment.name}/timeline/").json()
    assert timeline[0]["step"] == "created"
    samples = api_client(bob).get(f"/api/v1/deployments/{deployment.name}/samples/").json()
    assert samples[0]["running"] == 3 and samples[0]["kv_cache_usage"] == 0.5


def test_it_shows_state_timeline_command_log_and_sparklines_on_the_page(
    client, alice, deployment, reap_servers
):
    deployment_start(deployment.pk, owner="test")
    for _ in range(3):
        deployment_supervise(deployment.pk, owner="beat")
    client.force_login(alice)
    page = client.get(deployment.get_absolute_url()).content.decode()
    assert "serving" in page
    assert "-m vllm.entrypoints.openai.api_server" in page and "--served-model-name tiny-llama" in page
    assert "smoke test" in page and "warm-up" in page
    assert '<svg class="spark"' in page and "KV-cache usage" in page
    assert "INFO fake vLLM" in page  # the log tail
    assert 'action="/deployments/tiny/stop/"' in page


def test_it_hides_the_buttons_from_members_and_forbids_their_posts(client, bob, deployment):
    client.force_login(bob)
    page = client.get(deployment.get_absolute_url()).content.decode()
    assert "/deployments/tiny/stop/" not in page
    assert client.post("/deployments/tiny/stop/").status_code == 403


def test_it_hides_the_page_from_other_teams(client, charlie, deployment):
    client.force_login(charlie)
    assert client.get(deployment.get_absolute_url()).status_code == 404
    assert client.post("/deployments/tiny/stop/").status_code == 404


def test_it_stops_from_the_page(client, alice, deployment):
    client.force_login(alice)
    response = client.post("/deployments/tiny/stop/", follow=True)
    assert "stop requested" in response.content.decode()
    assert Deployment.objects.get(pk=deployment.pk).desired_state == "stopped"


# --- Adopted servers ---------------------------------------------------------------


@pytest.fixture
def external_server():
    """A minimal OpenAI-style server the portal did not start."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            body = b"" if self.path == "/health" else b"vllm:num_requests_running 1\n"
            self.send_response(200 if self.path in ("/health", "/metrics") else 404)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.parametrize(
    ("given", "stored"),
    [
        ("http://10.0.0.5:8000/v1", "http://10.0.0.5:8000"),
        ("http://10.0.0.5:8000/v1/", "http://10.0.0.5:8000"),
        ("https://gpu-7.example.com", "https://gpu-7.example.com"),
    ],
)
def test_it_stores_the_server_root_of_an_adopted_url(given, stored):
    assert endpoint_url_from(given) == stored


def test_it_adopts_a_server_with_the_command_and_health_checks_it(external_server, tiny_version, team):
    builders.team(name="Platform", slug="platform")
    call_command(
        "register_endpoint", "--model", "tiny-llama", "--url", f"{external_server}/v1", "--team", "platform"
    )
    adopted = Deployment.objects.get(adopted=True)
    assert adopted.name == "tiny-llama-adopted" and adopted.endpoint_url == external_server
    assert adopted.profile is None and adopted.node is None
    assert adopted.team.slug == "platform"
    assert adopted.state == "serving"  # checked by the command itself
    assert adopted_check(adopted.pk) == "serving"
    assert adopted.samples.first().running == 1


def test_it_marks_an_adopted_server_that_stops_answering_as_failed(tiny_version, team):
    call_command(
        "register_endpoint", "--model", "tiny-llama", "--url", "http://127.0.0.1:9/v1", "--team", "search"
    )
    adopted = Deployment.objects.get(adopted=True)
    assert adopted_check(adopted.pk) == "failed"
    assert "does not answer" in Deployment.objects.get(pk=adopted.pk).state_reason


def test_it_refuses_an_unknown_model_in_the_command(team):
    with pytest.raises(CommandError, match="--model: 'nope' is neither registered nor listed"):
        call_command("register_endpoint", "--model", "nope", "--url", "http://h:1/v1", "--team", "search")


def test_it_never_starts_stops_or_supervises_an_adopted_server(alice, tiny_version, team):
    response = api_client(alice).post(
        "/api/v1/deployments/register-endpoint/",
        {"name": "ext", "team": "search", "model_version": "tiny-llama", "url": "http://10.1.2.3:8000/v1"},
        format="json",
    )
    assert response.status_code == 201, response.json()
    assert response.json()["adopted"] is True and response.json()["profile"] is None
    stop = api_client(alice).post("/api/v1/deployments/ext/stop/")
    assert stop.status_code == 400 and "never started or stopped" in stop.json()["desired_state"][0]
    adopted = Deployment.objects.get(name="ext")
    assert deployment_start(adopted.pk, owner="agent") == "adopted"
    assert Deployment.objects.get(name="ext").desired_state == "running"


def test_it_refuses_the_register_api_to_members(bob, tiny_version, team):
    response = api_client(bob).post(
        "/api/v1/deployments/register-endpoint/",
        {"name": "ext", "team": "search", "model_version": "tiny-llama", "url": "http://10.1.2.3:8000/v1"},
        format="json",
    )
    assert response.status_code == 403
    assert not DeploymentEvent.objects.exists()


def test_it_registers_an_adopted_server_in_the_admin(client, django_user_model, tiny_version, team):
    admin = django_user_model.objects.create_superuser("root", "r@x", "pw")
    client.force_login(admin)
    response = client.post(
        reverse("admin:deployments_adoptedendpoint_add"),
        {"name": "ext", "team": team.pk, "model_version": tiny_version.pk, "url": "http://10.9.8.7:8000/v1"},
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    assert Deployment.objects.get(name="ext").endpoint_url == "http://10.9.8.7:8000"


def test_it_stops_at_once_what_never_ran(alice, deployment):
    response = api_client(alice).post(f"/api/v1/deployments/{deployment.name}/stop/")
    assert response.json()["state"] == "stopped"


def test_it_leaves_a_stop_of_a_running_server_to_the_agent(alice, deployment):
    Deployment.objects.filter(pk=deployment.pk).update(state="serving", pid=12345)
    response = api_client(alice).post(f"/api/v1/deployments/{deployment.name}/stop/")
    assert response.json()["state"] == "serving" and response.json()["desired_state"] == "stopped"


def test_it_refuses_a_bad_samples_limit(bob, deployment):
    response = api_client(bob).get(f"/api/v1/deployments/{deployment.name}/samples/?limit=lots")
    assert response.status_code == 400 and "limit" in response.json()


@pytest.mark.parametrize(
    ("desired", "state", "buttons"),
    [
        ("stopped", "stopped", ["start"]),
        ("running", "serving", ["restart", "stop"]),
        ("running", "failed", ["start", "restart", "stop"]),
    ],
)
def test_the_page_offers_only_the_actions_that_change_something(
    client, alice, team, dgx, profile_tp1, desired, state, buttons
):
    deployment = builders.deployment(
        name="llama7b-x", team=team, profile=profile_tp1, model_version=profile_tp1.model_version,
        node=dgx, gpu_indices=[0], desired_state=desired, state=state,
    )  # fmt: skip
    client.force_login(alice)
    html = client.get(f"/deployments/{deployment.name}/").content.decode()
    shown = [verb for verb in ("start", "restart", "stop") if f"/deployments/llama7b-x/{verb}/" in html]
    assert shown == buttons
