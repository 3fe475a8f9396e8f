"""`manage.py seed_demo`: the demo data `make run` loads, idempotent, with its passwords kept private."""

import pytest
from django.core.management import call_command

from portal.deployments.models import DeploymentProfile
from portal.inventory.models import Node
from portal.registry.models import ModelVersion

pytestmark = pytest.mark.django_db


def test_it_seeds_the_demo_once_however_often_it_runs(tmp_path):
    call_command("seed_demo", "--admin-password-file", str(tmp_path / "pw"))
    call_command("seed_demo", "--admin-password-file", str(tmp_path / "pw"))
    assert Node.objects.count() == 3
    assert Node.objects.get(name="dgx-v100-01").gpus.count() == 8
    assert ModelVersion.objects.count() == 5
    assert DeploymentProfile.objects.count() == 5
    assert (tmp_path / "pw").stat().st_mode & 0o077 == 0  # the admin password is not world-readable


def test_it_seeds_demo_v100_nodes_that_the_simulator_serves():
    from portal.deployments.models import Deployment

    call_command("seed_demo", "--sim-deployment")
    call_command("seed_demo", "--sim-deployment")
    assert set(Node.objects.filter(engine="sim").values_list("name", flat=True)) == {
        "dgx-v100-01",
        "pcie-v100-01",
    }
    assert Node.objects.get(name="local").engine == "vllm"
    deployment = Deployment.objects.get(name="llama-2-7b-sim-dgx")
    assert deployment.node.name == "dgx-v100-01"
    assert deployment.gpu_indices == list(range(8))
    assert deployment.desired_state == "running"


def test_it_seeds_profiles_the_planner_accepts_on_their_own_targets():
    from portal.deployments.services import profile_plan

    call_command("seed_demo")
    verdicts = {p.name: profile_plan(p).ok for p in DeploymentProfile.objects.all()}
    assert verdicts["v100-7b-fp16-tp8"] is True
    assert verdicts["v100-13b-fp16-tp2"] is True
    assert verdicts["v100-70b-gptq-tp8"] is True
    assert verdicts["example-bf16-on-v100"] is False
    assert verdicts["v100-16g-27b-gptq"] is False  # the fp16 embedding leaves no KV room


def test_it_narrows_an_existing_password_file_to_the_owner_before_writing_the_password(tmp_path):
    from django.contrib.auth import get_user_model

    password_file = tmp_path / "pw"
    password_file.write_text("left over\n")
    password_file.chmod(0o644)
    call_command("seed_demo", "--admin-password-file", str(password_file))
    assert password_file.stat().st_mode & 0o777 == 0o600
    admin = get_user_model().objects.get(username="admin")
    assert admin.check_password(password_file.read_text().strip())


def test_it_creates_no_superuser_when_the_password_file_cannot_be_written(tmp_path):
    from django.contrib.auth import get_user_model

    (tmp_path / "not-a-directory").write_text("")
    with pytest.raises(OSError):
        call_command("seed_demo", "--admin-password-file", str(tmp_path / "not-a-directory" / "pw"))
    assert not get_user_model().objects.filter(is_superuser=True).exists()
    # So a run with a usable path still creates the admin, with a password someone can read.
    call_command("seed_demo", "--admin-password-file", str(tmp_path / "pw"))
    admin = get_user_model().objects.get(username="admin")
    assert admin.check_password((tmp_path / "pw").read_text().strip())


def test_it_seeds_v100_profiles_without_the_features_vllm_marks_unsupported_on_volta():
    from portal.deployments.services import profile_plan

    call_command("seed_demo")
    v100 = DeploymentProfile.objects.filter(target_gpu__startswith="v100")
    assert v100.count() == 5
    for profile in v100:
        assert not profile.enable_chunked_prefill and not profile.enable_prefix_caching, profile.name
        codes = {finding.code for finding in profile_plan(profile).findings}
        assert not codes & {"chunked_prefill_on_volta", "prefix_caching_on_volta"}, profile.name
