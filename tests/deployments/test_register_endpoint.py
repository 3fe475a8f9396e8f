"""Adopting a running server from its URL alone: `register_endpoint` reads `/v1/models`, records
the model when the registry lacks it, checks the endpoint at once; `create_team` makes its owner."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.core.management import CommandError, call_command

from portal.core.errors import ApplicationError
from portal.deployments.models import Deployment
from portal.deployments.services import resolve_model
from portal.registry.models import ModelVersion
from portal.teams.models import Team
from tests.helpers import builders

pytestmark = pytest.mark.django_db


def serve(models: list[dict]):
    """A vLLM-like server: /health, /metrics and /v1/models listing `models`."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            bodies = {
                "/health": b"",
                "/metrics": b"vllm:num_requests_running 0\n",
                "/v1/models": json.dumps({"object": "list", "data": models}).encode(),
            }
            body = bodies.get(self.path, b"")
            self.send_response(200 if self.path in bodies else 404)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture
def vllm_server():
    server, url = serve([{"id": "qwen-ext", "root": "Qwen/Qwen2-0.5B", "max_model_len": 4096}])
    yield url
    server.shutdown()


def run(*args: str, capsys) -> str:
    call_command("register_endpoint", *args)
    return capsys.readouterr().out


def test_it_adopts_a_server_from_its_url_alone_recording_an_external_model_version(vllm_server, team, capsys):
    out = run("--url", f"{vllm_server}/v1", capsys=capsys)
    version = ModelVersion.objects.get(name="qwen-ext")
    assert version.external and version.max_position_embeddings == 4096 and version.source == vllm_server
    adopted = Deployment.objects.get(adopted=True)
    assert (adopted.model_version, adopted.team, adopted.state) == (version, team, "serving")
    assert out.strip().endswith(": serving")


def test_it_reads_the_models_config_when_its_root_is_a_directory_here(team, tiny_model_dir, capsys):
    server, url = serve([{"id": "tiny-ext", "root": str(tiny_model_dir), "max_model_len": 2048}])
    try:
        run("--url", url, capsys=capsys)
    finally:
        server.shutdown()
    version = ModelVersion.objects.get(name="tiny-ext")
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert not version.external and version.num_layers == config["num_hidden_layers"]
    assert version.path == str(tiny_model_dir)


def test_it_prints_the_state_the_endpoint_really_has(tiny_version, team, capsys):
    out = run("--model", "tiny-llama", "--url", "http://127.0.0.1:9/v1", capsys=capsys)
    assert Deployment.objects.get(adopted=True).state == "failed"
    assert ": failed (http://127.0.0.1:9/health does not answer)" in out


def test_it_uses_the_registered_version_of_a_served_name(vllm_server, team, tiny_version, capsys):
    ModelVersion.objects.filter(pk=tiny_version.pk).update(name="qwen-ext")
    run("--url", vllm_server, capsys=capsys)
    assert Deployment.objects.get(adopted=True).model_version_id == tiny_version.pk
    assert ModelVersion.objects.count() == 1


def test_it_tells_a_fresh_install_to_create_a_team_first(vllm_server):
    with pytest.raises(CommandError, match=r"no team yet; create one with `manage.py create_team <slug>`"):
        call_command("register_endpoint", "--url", vllm_server)


def test_it_asks_which_team_owns_it_when_there_are_several(vllm_server, team):
    builders.team(name="Platform", slug="platform")
    with pytest.raises(CommandError, match="--team: choose the owner: platform, search"):
        call_command("register_endpoint", "--url", vllm_server)
    assert not Deployment.objects.exists() and not ModelVersion.objects.exists()


def test_it_refuses_to_plan_an_external_model_version(vllm_server, team, capsys):
    run("--url", vllm_server, capsys=capsys)
    with pytest.raises(ApplicationError, match="recorded from a running server"):
        resolve_model("qwen-ext")


def test_it_creates_a_team_from_the_command_line(capsys):
    call_command("create_team", "search", "--name", "Search", "--gpu-quota", "4")
    team = Team.objects.get(slug="search")
    assert (team.name, team.gpu_quota) == ("Search", 4)
    assert "created team search" in capsys.readouterr().out


def test_it_refuses_a_team_slug_that_is_taken(team):
    with pytest.raises(CommandError, match=r"^slug: Team with this Slug already exists"):
        call_command("create_team", "search")


def test_it_shows_a_tiny_models_parameters_in_millions(tiny_version):
    assert tiny_version.params_display.endswith(" M") and tiny_version.params_display != "0.0 M"


def test_it_shows_an_external_version_as_such_on_the_model_pages(vllm_server, team, bob, client, capsys):
    run("--url", vllm_server, capsys=capsys)
    client.force_login(bob)
    assert "unknown (external)" in client.get("/models/").content.decode()
    page = client.get("/models/qwen-ext/").content.decode()
    assert "only its name and\nmax model length (4096) are known" in page


def register(user, url: str, name: str = "ext"):
    from tests.helpers.clients import api_client

    body = {"name": name, "team": "search", "model_version": "metadata-model", "url": url}
    return api_client(user).post("/api/v1/deployments/register-endpoint/", body, format="json")


@pytest.fixture
def metadata_model(db):
    from portal.registry.services import model_version_record_external

    return model_version_record_external(name="metadata-model", max_model_len=4096, source="")


@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254/v1",
        "http://169.254.10.20:8000",
        "http://[fe80::1]:8000/v1",
        "http://[fd00:ec2::254]/v1",
        "http://[::ffff:169.254.169.254]:80",
        "http://metadata.google.internal/v1",
    ],
)
def test_it_refuses_to_adopt_a_link_local_or_metadata_address(alice, team, metadata_model, url):
    response = register(alice, url)
    assert response.status_code == 400, response.json()
    assert "metadata" in response.json()["url"][0]
    assert not Deployment.objects.filter(name="ext").exists()


def test_it_refuses_a_name_that_resolves_to_a_link_local_address(alice, team, metadata_model, monkeypatch):
    import socket

    # DNS is not something a test can point at 169.254.x for real: this name resolves there.
    real = socket.getaddrinfo

    def resolve(host, *args, **kwargs):
        if host == "engine.example.internal":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("169.254.7.7", 8000))]
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    response = register(alice, "http://engine.example.internal:8000/v1")
    assert response.status_code == 400
    assert "169.254.7.7" in response.json()["url"][0]


def test_it_adopts_a_link_local_engine_whose_network_is_allowed(alice, team, metadata_model, settings):
    import ipaddress

    settings.ADOPTED_ENDPOINT_ALLOWED_NETWORKS = (ipaddress.ip_network("169.254.10.0/24"),)
    assert register(alice, "http://169.254.10.20:8000").status_code == 201
    refused = register(alice, "http://169.254.169.254/v1", name="ext-2")  # outside the allowed network
    assert refused.status_code == 400 and "metadata" in refused.json()["url"][0]
