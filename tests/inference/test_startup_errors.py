"""vLLM start-up logs → classified causes with fixes, from vLLM's and PyTorch's own wording."""

import pytest

from inference.startup_errors import CAUSES, classify_startup_log, last_error_line

# One real line per cause, as vLLM 0.32 / PyTorch print them (see each module named in
# inference/startup_errors.py); the ERROR prefixes are vLLM's multi-process log format.
REAL_LINES = {
    "cuda_out_of_memory": (
        "(EngineCore pid=812) ERROR 11-29 10:01:02 [core.py:1510] torch.OutOfMemoryError: CUDA out of "
        "memory. Tried to allocate 1.96 GiB. GPU 0 has a total capacity of 31.74 GiB of which "
        "1.02 GiB is free."
    ),
    "bf16_unsupported": (
        "ValueError: Bfloat16 is only supported on GPUs with compute capability of at least 8.0. Your "
        "Tesla V100-SXM2-32GB GPU has compute capability 7.0. You can use float16 instead by explicitly "
        "setting the `dtype` flag in CLI, for example: --dtype=half."
    ),
    "quantization_unsupported": (
        "ValueError: The quantization method awq is not supported for the current GPU. Minimum "
        "capability: 75. Current capability: 70."
    ),
    "kv_cache_too_small": (
        "ValueError: To serve at least one request with the model's max seq len (8192), (4.00 GiB KV "
        "cache is needed, which is larger than the available KV cache memory (1.23 GiB). Based on the "
        "available memory, the estimated maximum model length is 2512. Try increasing "
        "`gpu_memory_utilization` (which also controls CPU memory on the CPU backend) or decreasing "
        "`max_model_len` when initializing the engine."
    ),
    "cuda_graph_capture_failed": (
        "RuntimeError: CUDA error: operation not permitted when stream is capturing"
    ),
    "address_in_use": "OSError: [Errno 98] Address already in use",
    "attention_unsupported": (
        "ValueError: No valid attention backend found for cuda with AttentionSelectorConfig(head_size=16, "
        "dtype=torch.float16). Reasons: {FLASH_ATTN: [head_size not supported]}."
    ),
}


@pytest.mark.parametrize(("code", "line"), REAL_LINES.items())
def test_it_classifies_each_known_cause_from_its_real_wording(code, line):
    diagnosis = classify_startup_log(f"INFO starting\n{line}\nINFO shutting down\n")
    assert diagnosis is not None
    assert diagnosis.code == code
    assert diagnosis.evidence == line.strip()


def test_it_covers_the_seven_causes_the_issue_lists():
    codes = {cause.code for cause in CAUSES}
    assert set(REAL_LINES) <= codes


@pytest.mark.parametrize(
    ("line", "code"),
    [
        (
            "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` "
            "when initializing the engine",
            "kv_cache_too_small",
        ),
        (
            "ValueError: Free memory on device cuda:0 (2.1/31.74 GiB) on startup is less than desired GPU "
            "memory utilization (0.96, 30.47 GiB). Decrease GPU memory utilization or reduce GPU memory used "
            "by other processes.",
            "cuda_out_of_memory",
        ),
        (
            "ValueError: User-specified max_model_len (8192) is greater than the derived max_model_len "
            "(max_position_embeddings=4096 or model_max_length=4096 in model's config.json).",
            "max_model_len_exceeds_positions",
        ),
        ("ValueError: No common block size for 16 (CPU_ATTN: [MultipleOf(32)]).", "attention_unsupported"),
        (
            "RuntimeError: CUDA error: no kernel image is available for execution on the device",
            "no_kernel_image",
        ),
        ("api_server.py: error: unrecognized arguments: --swap-space", "unsupported_flag"),
        (
            "ERROR [uvicorn] error while attempting to bind on address ('10.0.0.5', 8000): "
            "address already in use",
            "address_in_use",
        ),
    ],
)
def test_it_knows_the_other_wordings_of_a_cause(line, code):
    assert classify_startup_log(line).code == code


def test_it_prefers_the_root_cause_over_the_generic_engine_failure_after_it():
    log = "\n".join(
        [
            "(EngineCore pid=1) ERROR ValueError: To serve at least one request with the model's max seq "
            "len (4096), (2.00 GiB KV cache is needed, which is larger than the available KV cache memory "
            "(0.50 GiB).",
            "RuntimeError: Engine core initialization failed. See root cause above.",
            "OSError: [Errno 98] Address already in use",  # noise from a retry, after the real error
        ]
    )
    assert classify_startup_log(log).code == "kv_cache_too_small"


def test_it_says_the_cause_the_fix_and_the_evidence_in_one_reason():
    reason = classify_startup_log(REAL_LINES["bf16_unsupported"]).reason()
    assert reason.startswith("bfloat16 is not supported on this GPU")
    assert "Fix: set the profile's dtype to float16" in reason
    assert "compute capability 7.0" in reason


def test_it_returns_none_for_a_log_with_no_known_cause():
    assert classify_startup_log("INFO all good\nRuntimeError: something new") is None


def test_it_finds_the_last_error_line_skipping_traceback_frames():
    log = 'Traceback (most recent call last):\n  File "x.py", line 1\nRuntimeError: boom\n\n'
    assert last_error_line(log) == "RuntimeError: boom"
