"""A profile becomes launch settings through one door (portal/deployments/launch.py), and its knobs
are listed once (inference/profile.py, ProfileSettings): every other door reads that list."""

from __future__ import annotations

from dataclasses import fields, make_dataclass

import pytest

from inference import profile as profile_record
from inference.profile import ProfileSettings, Write, knob, launch_knobs
from inference.sim.cli import build_parser
from inference.vllm_args import LaunchSettings, ServerArgs, knob_args, vllm_args
from portal.core.errors import ApplicationError
from portal.deployments.apis import PlanRequestSerializer, ProfileSerializer, _knob_serializer_fields
from portal.deployments.launch import launch_settings
from portal.deployments.management.commands.plan import Command as PlanCommand
from portal.deployments.models import DeploymentProfile
from tests.helpers import builders

SERVER = ServerArgs(model_path="/models/m", served_model_name="m", host="127.0.0.1", port=8000)

# A value other than each knob's default, to see its flag written.
OTHER = {
    "dtype": "bfloat16", "tensor_parallel_size": 2, "max_model_len": 4096, "gpu_memory_utilization": 0.8,
    "max_num_seqs": 64, "max_num_batched_tokens": 2048, "block_size": 32, "enable_prefix_caching": True,
    "enable_chunked_prefill": True, "enforce_eager": True, "quantization": "gptq", "swap_space_gb": 8.0,
    "kv_cache_dtype": "fp8",
}  # fmt: skip


@pytest.mark.parametrize("spec", fields(ProfileSettings), ids=lambda spec: spec.name)
def test_every_knob_reaches_every_door(spec):
    """Fails, naming the knob and the door, when a knob is added to ProfileSettings and a door spells
    its own list."""
    flag = spec.metadata["knob"].flag
    assert spec.name in {f.name for f in DeploymentProfile._meta.get_fields()}, "a column of the profile"
    assert spec.name in ProfileSerializer.Meta.fields, "the profile API"
    assert spec.name in PlanRequestSerializer().fields, "the planner API"
    assert spec.name in vars(build_parser().parse_args(["--model", "m"])), "the simulator's flags"
    plan = PlanCommand().create_parser("manage.py", "plan")
    assert spec.name in {action.dest for action in plan._actions}, "the plan and simulate commands"
    assert flag in knob_args(ProfileSettings(**{spec.name: OTHER[spec.name]})), "the argv"


def test_a_knob_added_to_profile_settings_alone_reaches_the_argv_the_simulator_and_the_planner_api(
    monkeypatch,
):
    extended = make_dataclass(
        "Extended",
        [("max_num_partial_prefills", int, knob(1, "--max-num-partial-prefills", Write.UNLESS_DEFAULT))],
        bases=(ProfileSettings,),
        frozen=True,
    )
    monkeypatch.setattr(profile_record, "ProfileSettings", extended)  # the one edit: the knob in the record

    assert [spec.name for spec, _ in launch_knobs()][-1] == "max_num_partial_prefills"
    assert knob_args(extended(max_num_partial_prefills=4))[-2:] == ["--max-num-partial-prefills", "4"]
    assert "--max-num-partial-prefills" not in knob_args(extended())
    parsed = build_parser().parse_args(["--model", "m", "--max-num-partial-prefills", "3"])
    assert parsed.max_num_partial_prefills == 3
    assert "max_num_partial_prefills" in _knob_serializer_fields()


def test_the_argv_is_the_knobs_as_written_before(profile_tp1):
    """The same flags, values and order as the hand-written list wrote."""
    args = knob_args(ProfileSettings(**OTHER))
    assert args == [
        "--dtype", "bfloat16", "--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.8",
        "--max-num-seqs", "64", "--block-size", "32", "--max-model-len", "4096",
        "--max-num-batched-tokens", "2048", "--enable-prefix-caching", "--enable-chunked-prefill",
        "--enforce-eager", "--quantization", "gptq", "--kv-cache-dtype", "fp8", "--swap-space", "8",
    ]  # fmt: skip
    assert knob_args(ProfileSettings()) == [
        "--dtype", "float16", "--tensor-parallel-size", "1", "--gpu-memory-utilization", "0.9",
        "--max-num-seqs", "256", "--block-size", "16", "--no-enable-prefix-caching",
        "--no-enable-chunked-prefill",
    ]  # fmt: skip


@pytest.mark.django_db
def test_a_profile_launches_with_its_knobs_extras_and_the_nodes_engine():
    profile = builders.profile(
        name="eager-8k", max_model_len=8192, enforce_eager=True, extra_args=["--seed", "1"]
    )
    launch = launch_settings(profile, engine_version="0.19.1")
    assert launch == LaunchSettings(
        ProfileSettings(max_model_len=8192, enforce_eager=True),
        extra_args=("--seed", "1"),
        engine_version="0.19.1",
    )
    args = vllm_args(launch, SERVER)
    assert args[8:12] == ["--dtype", "float16", "--tensor-parallel-size", "1"]
    assert "--enforce-eager" in args and args[-2:] == ["--seed", "1"]


@pytest.mark.django_db
def test_a_profile_the_nodes_engine_cannot_run_is_refused_naming_the_field():
    profile = builders.profile(name="swappy", swap_space_gb=8)
    with pytest.raises(ApplicationError) as refused:
        launch_settings(profile, engine_version="0.19.1")
    assert refused.value.field == "profile" and "--swap-space" in refused.value.message
    assert launch_settings(profile, engine_version="0.8.5.post2").profile.swap_space_gb == 8


@pytest.mark.django_db
def test_a_profile_whose_extras_set_a_portal_flag_is_refused_when_saved():
    profile = DeploymentProfile(name="sneaky", extra_args=["--port", "9"])
    with pytest.raises(Exception, match="--port is set by the portal") as refused:
        profile.full_clean()
    assert "extra_args" in refused.value.message_dict
