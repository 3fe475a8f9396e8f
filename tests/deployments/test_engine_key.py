"""Every engine gets a per-deployment API key; where servers listen is shown to staff only.

The key reaches the server through its environment (VLLM_API_KEY), never argv, the
command line, the timeline, the log or the audit log; everything the portal sends to
/v1/* (readiness, warm-up, smoke test) carries it. The real vLLM's 401/200 is proven
in tests/deployments/test_vllm_integration.py.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client

from inference import supervisor
from portal.audit.models import AuditEvent
from portal.deployments.agent.adopted import adopted_check
from portal.deployments.agent.start import deployment_start
from portal.deployments.agent.steps import event
from portal.deployments.models import Deployment
from tests.helpers import builders
from tests.helpers.builders import make_deployment
from tests.helpers.clients import api_client

pytestmark = pytest.mark.django_db


def _start(deployment) -> str:
    result = deployment_start(deployment.pk, owner="test-agent")
    deployment.refresh_from_db()
    return result


@pytest.fixture
def deployment(team, tiny_version, tiny_profile, fake_node, reap_servers):
    return make_deployment(team, tiny_version, tiny_profile, fake_node)


def _everything_shown(deployment) -> str:
    """Every text about the deployment a person could read somewhere."""
    return "\n".join(
        [
            " ".join(deployment.command),
            deployment.command_line,
            deployment.log_tail,
            deployment.state_reason,
            Path(deployment.log_path).read_text(),
            *deployment.events.values_list("message", flat=True),
            *(str(e.changes) for e in AuditEvent.objects.all()),
        ]
    )


def test_it_starts_the_engine_with_its_key_in_the_environment_only(deployment):
    assert _start(deployment) == "serving", deployment.state_reason
    key = deployment.engine_api_key
    assert len(key) >= 32
    environ = Path(f"/proc/{deployment.pid}/environ").read_bytes().split(b"\0")
    assert f"VLLM_API_KEY={key}".encode() in environ
    assert key not in _everything_shown(deployment)
    # The server refuses /v1 without it; the portal's own checks sent it (it is serving).
    assert supervisor.served_models(deployment.endpoint_url) is None
    assert supervisor.served_models(deployment.endpoint_url, api_key=key) == ["tiny-llama"]


def test_it_gives_each_deployment_its_own_key(team, tiny_version, tiny_profile, fake_node):
    one = make_deployment(team, tiny_version, tiny_profile, fake_node, name="one", desired_state="stopped")
    two = make_deployment(team, tiny_version, tiny_profile, fake_node, name="two", desired_state="stopped")
    assert one.engine_api_key and two.engine_api_key and one.engine_api_key != two.engine_api_key


def test_it_makes_a_key_at_start_for_a_deployment_created_without_one(deployment):
    Deployment.objects.filter(pk=deployment.pk).update(engine_api_key="")
    assert _start(deployment) == "serving", deployment.state_reason
    assert deployment.engine_api_key
    assert supervisor.served_models(deployment.endpoint_url) is None


def test_it_never_passes_the_agents_own_vllm_api_key_to_a_server(tmp_path, monkeypatch):
    import sys

    monkeypatch.setenv("VLLM_API_KEY", "the-agents-own")
    launched = supervisor.launch(
        [sys.executable, "-c", "import os; print(os.environ.get('VLLM_API_KEY'))"],
        log_path=tmp_path / "log",
        cuda_visible_devices="",
    )
    launched.process.wait(10)
    assert (tmp_path / "log").read_text().strip() == "None"


# --- Adopted servers ---------------------------------------------------------------------


def test_it_registers_an_adopted_server_with_a_key_it_never_shows(alice, tiny_version, team):
    response = api_client(alice).post(
        "/api/v1/deployments/register-endpoint/",
        {
            "name": "ext",
            "team": "search",
            "model_version": "tiny-llama",
            "url": "http://10.1.2.3:8000/v1",
            "api_key": "adopted-secret-1",
        },
        format="json",
    )
    assert response.status_code == 201, response.json()
    assert "adopted-secret-1" not in response.content.decode()
    assert Deployment.objects.get(name="ext").engine_api_key == "adopted-secret-1"
    assert "adopted-secret-1" not in str(list(AuditEvent.objects.values_list("changes", flat=True)))
    detail = api_client(alice).get("/api/v1/deployments/ext/")
    assert "adopted-secret-1" not in detail.content.decode()


def test_it_refuses_an_adopted_key_a_header_cannot_carry(alice, tiny_version, team):
    response = api_client(alice).post(
        "/api/v1/deployments/register-endpoint/",
        {"name": "ext", "team": "search", "model_version": "tiny-llama", "url": "http://h:1/v1",
         "api_key": "two words"},
        format="json",
    )  # fmt: skip
    assert response.status_code == 400 and "api_key" in response.json()
    assert not Deployment.objects.filter(name="ext").exists()


def test_it_registers_an_adopted_servers_key_from_a_file_with_the_command(tiny_version, team, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("file-secret-2\n")
    out = io.StringIO()
    call_command(
        "register_endpoint", "--model", "tiny-llama", "--url", "http://10.0.0.9:8000/v1",
        "--team", "search", "--api-key-file", str(key_file), stdout=out,
    )  # fmt: skip
    assert Deployment.objects.get(adopted=True).engine_api_key == "file-secret-2"
    assert "file-secret-2" not in out.getvalue()
    with pytest.raises(CommandError, match="--api-key-file"):
        call_command(
            "register_endpoint", "--model", "tiny-llama", "--url", "http://10.0.0.8:8000/v1",
            "--team", "search", "--api-key-file", str(tmp_path / "missing"),
        )  # fmt: skip


def test_it_health_checks_an_adopted_server_with_its_key(
    tiny_version, team, tmp_path, reap_servers, monkeypatch
):
    import sys

    from tests.helpers.deployments import FAKE_ENGINE

    port = supervisor.find_free_port()
    launched = supervisor.launch(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "m",
         "--served-model-name", "tiny-llama", "--port", str(port)],
        log_path=tmp_path / "log", cuda_visible_devices="", cwd=tmp_path, api_key="adopted-3",
        env={"PYTHONPATH": str(FAKE_ENGINE), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    reap_servers.append(launched.pgid)
    url = f"http://127.0.0.1:{port}"
    supervisor.wait_until_ready(
        url, "tiny-llama", deadline_s=20, alive=lambda: launched.process.poll() is None, api_key="adopted-3"
    )
    monkeypatch.setattr("sys.stdin", io.StringIO("adopted-3\n"))
    call_command(
        "register_endpoint", "--model", "tiny-llama", "--url", url, "--team", "search", "--api-key-file", "-"
    )
    adopted = Deployment.objects.get(adopted=True)
    assert adopted_check(adopted.pk) == "serving"
    # Registered with the wrong key: its /health still answers, but the gateway would get 401s.
    Deployment.objects.filter(pk=adopted.pk).update(engine_api_key="wrong")
    assert adopted_check(adopted.pk) == "failed"
    assert "refuses the registered API key" in Deployment.objects.get(pk=adopted.pk).state_reason


# --- Who sees where servers listen ----------------------------------------------------------


@pytest.fixture
def serving_remote(team, llama7b, profile_tp1, dgx):
    dgx.hostname = "gpu-07.dc.internal"
    dgx.save()
    deployment = builders.deployment(
        name="search-llama", team=team, model_version=llama7b, profile=profile_tp1, node=dgx,
        gpu_indices=[0], desired_state="running", state="serving", port=8123, pid=4242,
        endpoint_url="http://gpu-07.dc.internal:8123", command=["python", "--host", "gpu-07", "--port", "81"],
    )  # fmt: skip
    event(deployment.pk, "ready", "started", "waiting for /health at http://gpu-07.dc.internal:8123")
    event(deployment.pk, "command", "ok", "python --host gpu-07 --port 8123")
    event(deployment.pk, "serving", "ok", "serving at http://gpu-07.dc.internal:8123: 3.0 s")
    return deployment


STAFF_ONLY = ("endpoint_url", "port", "pid", "command_line")


def test_a_member_sees_no_endpoint_port_pid_or_command_in_the_api(bob, serving_remote):
    listed = api_client(bob).get("/api/v1/deployments/").json()
    rows = listed["results"] if isinstance(listed, dict) else listed
    detail = api_client(bob).get("/api/v1/deployments/search-llama/").json()
    for shown in (rows[0], detail):
        assert shown["name"] == "search-llama"
        assert not set(STAFF_ONLY) & set(shown)
    timeline = api_client(bob).get("/api/v1/deployments/search-llama/timeline/").content.decode()
    assert "gpu-07" not in timeline and "8123" not in timeline
    assert "gpu-07" not in str(api_client(bob).get("/api/v1/nodes/dgx-v100-01/").json())


def test_staff_see_endpoints_and_hostnames_in_the_api(alice, serving_remote):
    detail = api_client(alice).get("/api/v1/deployments/search-llama/").json()
    assert detail["endpoint_url"] == "http://gpu-07.dc.internal:8123" and detail["port"] == 8123
    assert api_client(alice).get("/api/v1/nodes/dgx-v100-01/").json()["hostname"] == "gpu-07.dc.internal"
    timeline = api_client(alice).get("/api/v1/deployments/search-llama/timeline/").content.decode()
    assert "gpu-07.dc.internal:8123" in timeline


def test_a_member_sees_no_endpoint_or_hostname_on_the_pages(bob, alice, serving_remote):
    member, staff = Client(), Client()
    member.force_login(bob)
    staff.force_login(alice)
    for path in ("/deployments/search-llama/", "/deployments/", "/nodes/dgx-v100-01/"):
        page = member.get(path)
        assert page.status_code == 200, path
        assert "gpu-07" not in page.content.decode() and ":8123" not in page.content.decode(), path
    assert "gpu-07.dc.internal:8123" in staff.get("/deployments/search-llama/").content.decode()
