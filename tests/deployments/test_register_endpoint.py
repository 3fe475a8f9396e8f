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


def test_it_adopts_a_server_from_its_url_alone_recording_an_external_model_version(
    vllm_server, team, capsys
):
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
