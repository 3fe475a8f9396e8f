"""The command-line contracts operators script against (docs/architecture.md#contracts)."""

import json

import pytest
from django.core.management import CommandError, call_command

from portal.deployments.models import DeploymentProfile
from portal.inventory.models import Node
from portal.registry.models import ModelVersion

pytestmark = pytest.mark.django_db

CONTRACT_KEYS = {
    "weights_gb_per_gpu",
    "kv_cache_tokens",
    "max_concurrent_seqs_at_max_len",
    "decode_tokens_per_s_ceiling",
    "findings",
    "ok",
}


def _plan_json(capsys, *args) -> dict:
    call_command("plan", *args, "--json")
    return json.loads(capsys.readouterr().out)


def test_it_prints_the_plan_json_with_the_contract_keys(capsys):
    plan = _plan_json(capsys, "--gpu", "v100-sxm2-32gb", "--gpus", "8", "--model", "llama-2-7b-chat-hf")
    assert plan.keys() >= CONTRACT_KEYS
    assert plan["ok"] is True
    assert abs(plan["weights_gb_per_gpu"] - 1.75) / 1.75 < 0.1
    assert all({"level", "code", "message"} == f.keys() for f in plan["findings"])


def test_it_reproduces_the_70b_4bit_decode_ceiling(capsys):
    plan = _plan_json(
        capsys,
        "--gpu",
        "v100-sxm2-32gb",
        "--gpus",
        "8",
        "--model",
        "llama-3.1-70b-instruct-gptq-4bit",
        "--max-model-len",
        "8192",
    )
    assert abs(plan["decode_tokens_per_s_ceiling"] - 180) / 180 < 0.1


def test_it_takes_a_path_to_a_config_json(capsys, tmp_path):
    from inference.hf_config import known_configs

    config = tmp_path / "config.json"
    config.write_text(known_configs()["llama-2-13b-chat-hf"].read_text())
    plan = _plan_json(
        capsys, "--gpu", "v100-sxm2-32gb", "--gpus", "2", "--model", str(config), "--max-model-len", "4096"
    )
    assert abs(plan["weights_gb_per_gpu"] - 13.0) < 0.5


def test_it_takes_a_registered_model_name(capsys, qwen_bf16):
    plan = _plan_json(
        capsys, "--gpu", "v100-sxm2-32gb", "--gpus", "1", "--model", qwen_bf16.name, "--dtype", "bfloat16"
    )
    assert plan["ok"] is False
    assert "bf16_unsupported" in {f["code"] for f in plan["findings"]}


def test_it_prints_a_readable_table_with_the_verdict(capsys):
    call_command("plan", "--gpu", "v100-sxm2-32gb", "--gpus", "3", "--model", "llama-2-7b-chat-hf")
    out = capsys.readouterr().out
    assert "weights per GPU" in out
    assert "tp_not_divisor" in out
    assert "verdict: REFUSED" in out


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["--gpu", "v999", "--gpus", "1", "--model", "llama-2-7b-chat-hf"], "--gpu"),
        (["--gpu", "t4", "--gpus", "0", "--model", "llama-2-7b-chat-hf"], "--gpus"),
        (["--gpu", "t4", "--gpus", "1", "--model", "no-such-model"], "--model"),
        (
            ["--gpu", "t4", "--gpus", "1", "--model", "llama-2-7b-chat-hf", "--gpu-memory-utilization", "7"],
            "--gpu-memory-utilization",
        ),
        (
            ["--gpu", "t4", "--gpus", "1", "--model", "llama-2-7b-chat-hf", "--max-model-len", "-5"],
            "--max-model-len",
        ),
    ],
)
def test_it_names_the_bad_flag_instead_of_a_traceback(args, field):
    with pytest.raises(CommandError, match=f"^{field}:"):
        call_command("plan", *args)


def test_it_names_the_field_of_a_malformed_config_file(tmp_path):
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "llama", "hidden_size": "big"}')
    with pytest.raises(CommandError, match="--model"):
        call_command("plan", "--gpu", "t4", "--gpus", "1", "--model", str(config))


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
