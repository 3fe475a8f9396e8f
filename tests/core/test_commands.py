"""The command-line contracts operators script against (docs/architecture.md#contracts)."""

import json

import pytest
from django.core.management import CommandError, call_command

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
