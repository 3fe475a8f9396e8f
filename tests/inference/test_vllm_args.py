"""Profile → vLLM argv, flag by flag."""

import pytest

from inference.errors import InputError
from inference.profile import ProfileSettings
from inference.vllm_args import LaunchSettings, ServerArgs, command_line, sim_command, vllm_args, vllm_command

SERVER = ServerArgs(
    model_path="/models/llama-2-7b", served_model_name="llama-2-7b-chat-hf", host="10.0.0.5", port=8123
)


def flag(args: list[str], name: str) -> str | None:
    """The value after a flag (None if absent)."""
    return args[args.index(name) + 1] if name in args else None


def test_it_names_the_model_the_served_name_and_where_to_listen():
    args = vllm_args(LaunchSettings(ProfileSettings()), SERVER)
    assert args[:8] == [
        "--model",
        "/models/llama-2-7b",
        "--served-model-name",
        "llama-2-7b-chat-hf",
        "--host",
        "10.0.0.5",
        "--port",
        "8123",
    ]


@pytest.mark.parametrize(
    ("setting", "value", "name", "expected"),
    [
        ("dtype", "float16", "--dtype", "float16"),
        ("dtype", "bfloat16", "--dtype", "bfloat16"),
        ("tensor_parallel_size", 8, "--tensor-parallel-size", "8"),
        ("gpu_memory_utilization", 0.93, "--gpu-memory-utilization", "0.93"),
        ("max_num_seqs", 64, "--max-num-seqs", "64"),
        ("block_size", 32, "--block-size", "32"),
        ("max_model_len", 6144, "--max-model-len", "6144"),
        ("max_num_batched_tokens", 2048, "--max-num-batched-tokens", "2048"),
        ("quantization", "gptq", "--quantization", "gptq"),
        ("kv_cache_dtype", "fp8", "--kv-cache-dtype", "fp8"),
        ("swap_space_gb", 8.0, "--swap-space", "8"),
    ],
)
def test_it_writes_each_valued_setting_as_its_vllm_flag(setting, value, name, expected):
    assert flag(vllm_args(LaunchSettings(ProfileSettings(**{setting: value})), SERVER), name) == expected


@pytest.mark.parametrize(
    ("name", "absent_when"),
    [
        ("--max-model-len", {"max_model_len": None}),
        ("--max-num-batched-tokens", {"max_num_batched_tokens": None}),
        ("--quantization", {"quantization": None}),
        ("--kv-cache-dtype", {"kv_cache_dtype": "auto"}),
        # vLLM ≥ 0.11 has no --swap-space: only a non-default value writes it.
        ("--swap-space", {"swap_space_gb": 4.0}),
    ],
)
def test_it_leaves_out_flags_that_would_only_repeat_vllms_default(name, absent_when):
    assert name not in vllm_args(LaunchSettings(ProfileSettings(**absent_when)), SERVER)


@pytest.mark.parametrize(
    ("setting", "on", "off"),
    [
        ("enable_prefix_caching", "--enable-prefix-caching", "--no-enable-prefix-caching"),
        ("enable_chunked_prefill", "--enable-chunked-prefill", "--no-enable-chunked-prefill"),
    ],
)
def test_it_says_on_or_off_explicitly_for_switches_whose_default_changed(setting, on, off):
    assert on in vllm_args(LaunchSettings(ProfileSettings(**{setting: True})), SERVER)
    args = vllm_args(LaunchSettings(ProfileSettings(**{setting: False})), SERVER)
    assert off in args and on not in args


def test_it_adds_enforce_eager_only_when_asked():
    assert "--enforce-eager" in vllm_args(LaunchSettings(ProfileSettings(enforce_eager=True)), SERVER)
    assert "--enforce-eager" not in vllm_args(LaunchSettings(ProfileSettings(enforce_eager=False)), SERVER)


def test_it_appends_extra_args_last_so_they_win():
    args = vllm_args(
        LaunchSettings(ProfileSettings(), extra_args=["--seed", "0", "--max-num-seqs", "8"]), SERVER
    )
    assert args[-4:] == ["--seed", "0", "--max-num-seqs", "8"]


@pytest.mark.parametrize(
    "extra", [["--port", "9000"], ["--host=0.0.0.0"], ["--model", "/x"], ["--served-model-name", "y"]]
)
def test_it_refuses_extra_args_that_move_the_server_away_from_the_portal(extra):
    with pytest.raises(InputError, match="is set by the portal") as error:
        vllm_args(LaunchSettings(ProfileSettings(), extra_args=extra), SERVER)
    assert error.value.field == "extra_args"


def test_it_refuses_a_port_out_of_range():
    with pytest.raises(InputError, match="port"):
        vllm_args(LaunchSettings(ProfileSettings()), ServerArgs("/m", "m", "127.0.0.1", 70000))


def test_it_builds_the_fieldnotes_v100_recipe():
    profile = ProfileSettings(
        dtype="float16",
        tensor_parallel_size=8,
        max_model_len=4096,
        gpu_memory_utilization=0.93,
        max_num_seqs=256,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        enforce_eager=True,
    )
    argv = vllm_command("/opt/vllm/bin/python", vllm_args(LaunchSettings(profile), SERVER))
    assert command_line(argv) == (
        "/opt/vllm/bin/python -m vllm.entrypoints.openai.api_server --model /models/llama-2-7b "
        "--served-model-name llama-2-7b-chat-hf --host 10.0.0.5 --port 8123 --dtype float16 "
        "--tensor-parallel-size 8 --gpu-memory-utilization 0.93 --max-num-seqs 256 --block-size 16 "
        "--max-model-len 4096 --enable-prefix-caching --enable-chunked-prefill --enforce-eager"
    )


def test_it_runs_the_simulator_with_the_same_flags_plus_the_hardware():
    args = vllm_args(LaunchSettings(ProfileSettings(max_model_len=4096)), SERVER)
    argv = sim_command("/usr/bin/python3", args, hardware="v100-sxm2-32gb")
    assert argv[:3] == ["/usr/bin/python3", "-m", "inference.sim"]
    assert argv[3:-2] == args
    assert argv[-2:] == ["--hardware", "v100-sxm2-32gb"]
    assert "--hardware" not in sim_command("/usr/bin/python3", args, hardware=None)


@pytest.mark.parametrize(
    ("extra", "reads_as"),
    [
        (["--hos", "10.0.0.9"], "--host"),
        (["--por=9000"], "--port"),
        (["--served_model_name", "other"], "--served-model-name"),
        (["--served_model_name=other"], "--served-model-name"),
        (["--api_key", "k"], "--api-key"),
        (["--api-key=k"], "--api-key"),
        (["--middleware", "my.module.app"], "--middleware"),
        (["--root-path", "/v"], "--root-path"),
        (["--root_path=/v"], "--root-path"),
    ],
)
def test_it_refuses_extra_args_that_set_a_portal_flag_in_any_spelling_vllm_accepts(extra, reads_as):
    with pytest.raises(InputError, match="is set by the portal") as error:
        vllm_args(LaunchSettings(ProfileSettings(), extra_args=extra), SERVER)
    assert error.value.field == "extra_args" and reads_as in error.value.message


@pytest.mark.parametrize("version", ["0.8.5.post2", "0.19.1", "0.26.0", "0.32.0"])
def test_it_keeps_prefix_caching_and_chunked_prefill_off_on_every_engine_line(version):
    args = vllm_args(LaunchSettings(ProfileSettings(), engine_version=version), SERVER)
    assert "--no-enable-prefix-caching" in args and "--no-enable-chunked-prefill" in args


def test_it_refuses_a_swap_space_the_nodes_vllm_no_longer_has():
    with pytest.raises(InputError, match="has no --swap-space") as error:
        vllm_args(LaunchSettings(ProfileSettings(swap_space_gb=8), engine_version="0.19.1"), SERVER)
    assert error.value.field == "profile" and "0.8.5 line" in error.value.message


def test_it_writes_swap_space_for_the_v0_line_that_has_it():
    args = vllm_args(LaunchSettings(ProfileSettings(swap_space_gb=8), engine_version="0.8.5.post2"), SERVER)
    assert flag(args, "--swap-space") == "8"
