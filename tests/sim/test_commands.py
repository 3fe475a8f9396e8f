"""`manage.py simulate`, the planner's "predict this profile" page, and the demo profiles on the simulator."""

from __future__ import annotations

import json
import time

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from inference.sim.cli import build_parser, engine_from_args
from inference.sim.costs import HostCosts
from inference.sim.engine import EngineRefused
from portal.dashboard.management.commands.seed_demo import PROFILES, V100_DEFAULTS

pytestmark = pytest.mark.django_db

SMALL = ["--gpu", "v100-sxm2-32gb", "--gpus", "8", "--model", "llama-2-7b-chat-hf", "--max-model-len", "4096"]


def test_it_prints_the_benchmark_json_shape_with_the_sla_concurrency(capsys):
    call_command(
        "simulate",
        *SMALL,
        "--mix",
        "short-qa",
        "--concurrency",
        "8,16",
        "--requests-per-level",
        "40",
        "--json",
    )
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"levels", "sla_concurrency", "calibration"}
    assert result["calibration"] == HostCosts().as_dict()  # uncalibrated: the defaults
    assert [level["concurrency"] for level in result["levels"]] == [8, 16]
    level = result["levels"][0]
    for key in (
        "completed",
        "failed",
        "output_throughput",
        "mean_ttft_ms",
        "p95_ttft_ms",
        "mean_tpot_ms",
        "p95_tpot_ms",
    ):
        assert key in level
    assert level["completed"] == 40
    assert result["sla_concurrency"] == 16


def test_it_prints_the_table_and_the_operating_point(capsys):
    call_command(
        "simulate", *SMALL, "--mix", "fixed:500:100", "--concurrency", "4", "--requests-per-level", "20"
    )
    out = capsys.readouterr().out
    assert "out tok/s" in out and "P95 TTFT ms" in out
    assert "SLA operating point: 4" in out
    # Issue 40: how sure the twin is, per level (uncalibrated here: its wide ranges, and why).
    assert "4 users: output tok/s" in out and "uncalibrated" in out


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--concurrency", "16,0"], "--concurrency"),
        (["--concurrency", "sixteen"], "--concurrency"),
        (["--mix", "no-such-mix"], "--mix"),
        (["--requests-per-level", "0"], "--requests-per-level"),
        (["--block-size", "7"], "--block-size"),
    ],
)
def test_it_names_the_bad_flag(args, flag):
    with pytest.raises(CommandError, match=f"^{flag}:"):
        call_command("simulate", *SMALL, *args)


def test_it_says_why_a_profile_cannot_be_simulated():
    with pytest.raises(CommandError, match="Bfloat16"):
        call_command("simulate", *SMALL, "--dtype", "bfloat16")


def test_it_refuses_a_model_config_it_cannot_read(tmp_path):
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "llama"}')
    with pytest.raises(CommandError, match="--model"):
        call_command("simulate", "--gpu", "t4", "--gpus", "1", "--model", str(config))


@pytest.fixture
def demo(db):
    call_command("seed_demo")


def test_it_predicts_a_profile_from_the_planner_page(client, bob, demo):
    client.force_login(bob)
    page = client.get(
        "/planner/predict/",
        {"model": "llama-2-7b-chat-hf", "gpu": "v100-sxm2-32gb", "gpus": 8, "dtype": "float16",
         "max_model_len": 4096, "gpu_memory_utilization": 0.93, "max_num_seqs": 256, "block_size": 16,
         "enforce_eager": "on", "enable_chunked_prefill": "on", "mix": "short-qa", "concurrency": "4,8"},
    )  # fmt: skip
    assert page.status_code == 200
    text = page.content.decode()
    assert '<table class="levels sweep">' in text and "output tok/s" in text and "<pre" not in text
    assert "SLA operating point: 8" in text
    # A simulation says so: "predicted", never "measured"; and it is drawn like a run's levels.
    assert "8 is the highest level predicted" in text and "level measured" not in text
    assert text.count('<svg xmlns="http://www.w3.org/2000/svg" class="plot"') == 3


def test_it_offers_the_prediction_on_the_planner_page(client, bob, demo):
    client.force_login(bob)
    page = client.get("/planner/", {"profile": "v100-7b-fp16-tp8"}).content.decode()
    assert "Predict this profile" in page
    assert "/planner/predict/" in page


def test_it_shows_the_refusal_instead_of_a_prediction(client, bob, demo):
    client.force_login(bob)
    page = client.get(
        "/planner/predict/",
        {"model": "llama-2-7b-chat-hf", "gpu": "v100-sxm2-32gb", "gpus": 1, "dtype": "bfloat16",
         "gpu_memory_utilization": 0.9, "max_num_seqs": 16, "block_size": 16},
    ).content.decode()  # fmt: skip
    assert "Bfloat16" in page


PREDICT = {"model": "llama-2-7b-chat-hf", "gpu": "v100-sxm2-32gb", "gpus": 8, "dtype": "float16",
           "max_model_len": 4096, "gpu_memory_utilization": 0.93, "max_num_seqs": 256, "block_size": 16,
           "enforce_eager": "on", "enable_chunked_prefill": "on", "mix": "short-qa"}  # fmt: skip


@pytest.mark.parametrize(
    ("concurrency", "says"),
    [
        ("100000,100000", "at most 1024"),
        ("4,8,16,32,64,128,256,512,1024", "at most 8 levels"),
        ("1" * 5000, "whole numbers"),
        ("²", "whole numbers"),
    ],
)
def test_it_bounds_the_predicted_levels_before_simulating_anything(client, bob, demo, concurrency, says):
    client.force_login(bob)
    started = time.monotonic()
    page = client.get("/planner/predict/", PREDICT | {"concurrency": concurrency})
    assert page.status_code == 400
    assert says in page.content.decode()
    assert time.monotonic() - started < 5  # refused, not simulated


def test_it_stops_a_prediction_at_its_time_budget(client, bob, demo, settings):
    settings.PREDICT_TIME_BUDGET_S = 0.2
    client.force_login(bob)
    started = time.monotonic()
    page = client.get("/planner/predict/", PREDICT | {"mix": "field-mix", "concurrency": "256,512,1024"})
    elapsed = time.monotonic() - started
    assert page.status_code == 400
    text = page.content.decode()
    assert "ran out of its 0.2 s budget during level 256" in text and "0 of 3 levels done" in text
    assert elapsed < 10, elapsed  # the whole sweep takes minutes on this machine


def test_it_reads_no_mix_file_from_the_prediction_page(client, bob, demo, tmp_path):
    mix = tmp_path / "mix.json"
    mix.write_text('{"buckets": [{"share": 1, "prompt": 10, "output": 5}]}')
    client.force_login(bob)
    page = client.get("/planner/predict/", PREDICT | {"mix": str(mix), "concurrency": "4"})
    assert page.status_code == 400
    assert "unknown mix" in page.content.decode()


def test_it_sends_anonymous_visitors_of_the_prediction_to_log_in(client, demo):
    response = client.get("/planner/predict/", {"model": "llama-2-7b-chat-hf"})
    assert response.status_code == 302


def _argv(profile: dict) -> list[str]:
    spec = {**V100_DEFAULTS, **profile}
    argv = [
        "--model", spec["model"], "--hardware", spec["target_gpu"],
        "--tensor-parallel-size", str(spec.get("tensor_parallel_size", 1)), "--dtype", spec["dtype"],
        "--max-model-len", str(spec["max_model_len"]), "--max-num-seqs", str(spec["max_num_seqs"]),
        "--gpu-memory-utilization", str(spec["gpu_memory_utilization"]),
        "--block-size", str(spec["block_size"]),
    ]  # fmt: skip
    for flag in ("enable_prefix_caching", "enable_chunked_prefill", "enforce_eager"):
        if spec.get(flag):
            argv.append("--" + flag.replace("_", "-"))
    if spec.get("quantization"):
        argv += ["--quantization", spec["quantization"]]
    if spec.get("max_num_batched_tokens"):
        argv += ["--max-num-batched-tokens", str(spec["max_num_batched_tokens"])]
    return argv


@pytest.mark.parametrize("profile", PROFILES, ids=[p["name"] for p in PROFILES])
def test_it_starts_the_demo_profiles_the_planner_accepts_and_refuses_the_others(profile):
    args = build_parser().parse_args(_argv(profile))
    if profile["name"] in ("example-bf16-on-v100", "v100-16g-27b-gptq"):
        with pytest.raises(EngineRefused):
            engine_from_args(args)
    else:
        engine, _, _ = engine_from_args(args)
        assert engine.num_blocks > 0
