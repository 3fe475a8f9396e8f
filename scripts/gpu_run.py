"""Measure a real GPU node through the portal's own launch and benchmark code, without Django.

What node acceptance does on a GPU node, as one script that needs only the node's vLLM
environment (torch, vLLM, aiohttp, tokenizers, safetensors) and this repository's
`inference/` package. It is how the runs in docs/gpu-runs.md were made on the borrowed
H200, where the portal's own dependencies (Django, PostgreSQL) are not installed:

    python3 scripts/gpu_run.py discover --out $OUT
    python3 scripts/gpu_run.py serve --out $OUT --shape llama-2-7b-chat-hf --mode eager \\
        --levels 1,16,64,256 --requests 3,32,128,256

`serve` writes a random-weight fp16 model in the shape of a bundled config (shards written
from the GPU: a 7B model takes seconds, not the minutes numpy needs), starts it with
`inference.vllm_args` + `inference.supervisor` (the argv, process group, readiness wait,
warm-up and smoke test of every deployment), benchmarks the levels with
`inference.loadgen.loadgen`, and writes `bench-<shape>-<mode>.json` in the format of
`manage.py bench --json` (what `manage.py simulate --calibrate-from` reads), plus the
engine's start time and versions. `--parity C` also runs vLLM's own `bench serve` on the
same server at concurrency C with fixed lengths, beside the portal's bench with the same.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from inference import server_log, supervisor  # noqa: E402
from inference.env_probe import probe_environment  # noqa: E402
from inference.hf_config import known_configs  # noqa: E402
from inference.loadgen.loadgen import BenchConfig, LevelPlan, run_blocking, run_sweep  # noqa: E402
from inference.loadgen.sla import Sla, operating_point  # noqa: E402
from inference.loadgen.summary import format_table  # noqa: E402
from inference.loadgen.workloads import load_mix  # noqa: E402
from inference.profile import ProfileSettings  # noqa: E402
from inference.vllm_args import LaunchSettings, ServerArgs, command_line, vllm_args, vllm_command  # noqa: E402

# What vLLM needs on the borrowed machine (its own address does not resolve; FlashInfer's
# sampler would compile kernels with nvcc at start; nothing may reach a hub).
VLLM_ENV = {
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "NCCL_NVLS_ENABLE": "0",
}
MAX_MODEL_LEN = 4096
MAX_NUM_BATCHED_TOKENS = 8192


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def discover(out: Path) -> dict:
    from inference.nvidia_smi import QUERY_COMMAND, TOPO_COMMAND, discover_local

    record: dict = {}
    for name, argv in (("query", QUERY_COMMAND), ("topo", TOPO_COMMAND)):
        done = subprocess.run(argv, capture_output=True, text=True, check=False)  # noqa: S603
        (out / f"nvidia-smi-{name}.txt").write_text(done.stdout)
        record[f"{name}_returncode"] = done.returncode
    try:
        readings, topology = discover_local()
        record["gpus"] = [reading.__dict__ for reading in readings]
        record["topology"] = {
            "indices": topology.indices,
            "nvlink_peers": {i: topology.nvlink_peers(i) for i in topology.indices},
            "summary": topology.interconnect_summary(),
        }
    except Exception as error:  # the point is to record whatever the parser says
        record["error"] = f"{type(error).__name__}: {error}"
    log(f"discovery: {json.dumps(record, default=str)[:600]}")
    return record


def write_random_model(
    shape: str, directory: Path, *, layers: int | None = None, weights: bool = True
) -> Path:
    """A bundled config's shape with random fp16 weights, generated on the GPU, and a trained tokenizer.

    `weights=False` writes only the config and tokenizer, for vLLM's `--load-format dummy`.
    """
    import torch
    from safetensors.torch import save_file

    from inference.tiny_model import CHAT_TEMPLATE, train_tokenizer

    if (directory / "config.json").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    config = json.loads(known_configs()[shape].read_text())
    tokenizer = train_tokenizer(8192)
    vocab = tokenizer.get_vocab_size()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "model_max_length": MAX_MODEL_LEN,
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )
    config.update(
        vocab_size=vocab,
        torch_dtype="float16",
        bos_token_id=tokenizer.token_to_id("<s>"),
        eos_token_id=tokenizer.token_to_id("</s>"),
        max_position_embeddings=max(MAX_MODEL_LEN, config.get("max_position_embeddings", 0)),
    )
    config.pop("quantization_config", None)
    if layers:
        config["num_hidden_layers"] = layers  # a shorter model of the same shape (tests on a CPU)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    if not weights:
        return directory
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device=device).manual_seed(0)

    def rand(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims, generator=generator, device=device, dtype=torch.float16) * 0.02).cpu()

    index: dict[str, str] = {}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        tensors = {
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": rand(inter, hidden),
            p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
            # Qwen2 projects q, k and v with a bias; vLLM refuses a checkpoint without them
            **(
                {
                    p + "self_attn.q_proj.bias": rand(heads * head_dim),
                    p + "self_attn.k_proj.bias": rand(kv_heads * head_dim),
                    p + "self_attn.v_proj.bias": rand(kv_heads * head_dim),
                }
                if config.get("model_type") == "qwen2"
                else {}
            ),
            p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.float16),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.float16),
        }
        name = f"model-{layer:05d}.safetensors"
        save_file(tensors, str(directory / name), metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, name))
    tail = {
        "model.embed_tokens.weight": rand(vocab, hidden),
        "model.norm.weight": torch.ones(hidden, dtype=torch.float16),
        "lm_head.weight": rand(vocab, hidden),
    }
    save_file(tail, str(directory / "model-tail.safetensors"), metadata={"format": "pt"})
    index.update(dict.fromkeys(tail, "model-tail.safetensors"))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    return directory


def profile_for(mode: str, tp: int) -> ProfileSettings:
    return ProfileSettings(
        dtype="float16",
        tensor_parallel_size=tp,
        max_model_len=MAX_MODEL_LEN,
        gpu_memory_utilization=0.9,
        max_num_seqs=256,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        enable_prefix_caching=False,
        enable_chunked_prefill=True,
        enforce_eager=mode == "eager",
    )


def bench(
    base_url: str, model: str, model_dir: Path, *, mix: str, levels: list[int], requests: list[int]
) -> dict:
    sla = Sla(3.0, 0.2)
    config = BenchConfig(
        base_url=base_url,
        model=model,
        mix=load_mix(mix),
        levels=[
            LevelPlan(concurrency=c, requests=n, warmup=min(c, 16))
            for c, n in zip(levels, requests, strict=True)
        ],
        tokenizer=str(model_dir),
        slo={"ttft": sla.p95_ttft_s * 1000, "tpot": sla.p95_tpot_s * 1000},
    )
    result = run_blocking(run_sweep(config))
    for level in result.levels:
        level.pop("samples", None)
    concurrency, why = operating_point(result.levels, sla)
    log("\n" + format_table(result.levels))
    return {
        "url": base_url,
        "model": model,
        "mix": mix,
        "prompt_source": result.prompt_source,
        "prompt_tokens_exact": result.prompt_tokens_exact,
        "levels": result.levels,
        "sla": {"p95_ttft_s": sla.p95_ttft_s, "p95_tpot_s": sla.p95_tpot_s},
        "sla_concurrency": concurrency,
        "sla_reason": why,
        "error": result.error,
    }


def vllm_bench_serve(
    base_url: str,
    model: str,
    model_dir: Path,
    out: Path,
    *,
    concurrency: int,
    prompts: int,
    input_len: int,
    output_len: int,
) -> dict:
    """vLLM's own benchmark on the same server and lengths; its result JSON."""
    name = f"vllm-bench-c{concurrency}.json"
    argv = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve",
        "--backend", "vllm", "--base-url", base_url, "--model", model, "--tokenizer", str(model_dir),
        "--dataset-name", "random", "--random-input-len", str(input_len),
        "--random-output-len", str(output_len), "--ignore-eos", "--max-concurrency", str(concurrency),
        "--num-prompts", str(prompts), "--save-result", "--result-dir", str(out), "--result-filename", name,
        "--percentile-metrics", "ttft,tpot,itl,e2el",
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, check=False, env={**os.environ, **VLLM_ENV})  # noqa: S603
    log(done.stdout[-3000:] + done.stderr[-1500:])
    path = out / name
    return json.loads(path.read_text()) if path.exists() else {"error": done.stderr[-500:]}


def serve(options: argparse.Namespace) -> None:
    out = Path(options.out)
    python = options.vllm_python
    facts = probe_environment(python)
    layers = getattr(options, "layers", None)
    name = f"{options.shape}-L{layers}" if layers else options.shape
    model_dir = Path(options.models) / name
    began = time.monotonic()
    write_random_model(options.shape, model_dir, layers=layers)
    log(f"model {name} written in {time.monotonic() - began:.1f} s")
    levels = [int(x) for x in options.levels.split(",")]
    requests = [int(x) for x in options.requests.split(",")]
    for mode in options.mode.split(","):
        profile = profile_for(mode, options.tp)
        port = supervisor.find_free_port()
        args = vllm_args(
            LaunchSettings(profile), ServerArgs(str(model_dir), options.shape, "127.0.0.1", port)
        )
        argv = vllm_command(python, args)
        log_path = out / f"server-{name}-{mode}.log"
        log(f"starting: {command_line(argv)}")
        started = time.monotonic()
        launched = supervisor.launch(
            argv, log_path=log_path, cuda_visible_devices=options.gpus, env={**os.environ, **VLLM_ENV}
        )
        base_url = f"http://127.0.0.1:{port}"
        record: dict = {
            "shape": options.shape,
            "layers": layers,
            "mode": mode,
            "argv": command_line(argv),
            "versions": facts.__dict__,
        }
        try:
            supervisor.wait_until_ready(
                base_url, options.shape, deadline_s=480,
                alive=lambda process=launched.process: process.poll() is None,
                returncode=launched.process.poll,
            )  # fmt: skip
            record["ready_s"] = round(time.monotonic() - started, 1)
            record["warm_up_s"] = supervisor.warm_up(base_url, options.shape)
            record["smoke"] = supervisor.smoke_test(base_url, options.shape)[:80]
            log(f"{mode}: ready in {record['ready_s']} s")
            report = bench(
                base_url, options.shape, model_dir, mix=options.mix, levels=levels, requests=requests
            )
            report["engine"] = record
            (out / f"bench-{name}-{mode}.json").write_text(json.dumps(report, indent=2))
            parity: dict = {}
            for c in [int(x) for x in options.parity.split(",") if x] if mode == options.parity_mode else []:
                parity[c] = {
                    "vllm": vllm_bench_serve(base_url, options.shape, model_dir, out, concurrency=c,
                                             prompts=4 * c, input_len=1000, output_len=300),
                    "portal": bench(base_url, options.shape, model_dir, mix="fixed:1000:300",
                                    levels=[c], requests=[4 * c]),
                }  # fmt: skip
                (out / f"parity-{options.shape}-{mode}.json").write_text(json.dumps(parity, indent=2))
        except Exception as error:
            record["error"] = f"{type(error).__name__}: {error}"
            log(f"{mode} failed: {record['error']}\n{server_log.log_tail(log_path)}")
            (out / f"bench-{name}-{mode}.json").write_text(json.dumps({"engine": record}, indent=2))
        finally:
            stopped = time.monotonic()
            result = supervisor.stop_group(launched.pgid, grace_s=30)
            log(f"{mode}: stopped ({result}) in {time.monotonic() - stopped:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("discover")
    d.add_argument("--out", required=True)
    m = sub.add_parser("model", help="only write the random-weight model (what scripts/gpu_node.py deploys)")
    m.add_argument("--shape", default="llama-2-7b-chat-hf", help="a bundled config name")
    m.add_argument("--dir", required=True, help="the model directory to write")
    s = sub.add_parser("serve")
    s.add_argument("--out", required=True)
    s.add_argument("--shape", default="llama-2-7b-chat-hf", help="a bundled config name")
    s.add_argument("--models", default="/tmp/models")  # noqa: S108 - the GPU machine's scratch disk
    s.add_argument("--mode", default="eager,graphs")
    s.add_argument("--tp", type=int, default=1)
    s.add_argument("--gpus", default="0", help="CUDA_VISIBLE_DEVICES for the engine")
    s.add_argument("--levels", default="1,16,64,256")
    s.add_argument("--requests", default="3,32,128,256")
    s.add_argument("--mix", default="field-mix")
    s.add_argument("--parity", default="", help="also run vLLM's bench serve at these concurrencies")
    s.add_argument("--parity-mode", default="graphs")
    s.add_argument("--vllm-python", default=sys.executable)
    s.add_argument("--layers", type=int, default=None, help="cut the shape to this many layers")
    w = sub.add_parser("sweep", help="serve several shape:layers:mode variants one after another (issue 40)")
    w.add_argument("--out", required=True)
    w.add_argument("--variants", required=True, help="shape:layers:mode,... (layers 0 = all)")
    w.add_argument("--models", default="/tmp/models")  # noqa: S108 - the GPU machine's scratch disk
    w.add_argument("--levels", default="1,8,32")
    w.add_argument("--requests", default="4,16,64")
    w.add_argument("--mix", default="fixed:128:256")
    w.add_argument("--vllm-python", default=sys.executable)
    options = parser.parse_args()
    if options.command == "model":
        began = time.monotonic()
        write_random_model(options.shape, Path(options.dir))
        log(f"model {options.shape} written to {options.dir} in {time.monotonic() - began:.1f} s")
        return
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    if options.command == "discover":
        (out / "discovery.json").write_text(json.dumps(discover(out), indent=2, default=str))
    elif options.command == "sweep":
        for variant in options.variants.split(","):
            shape, layers, mode = variant.split(":")
            serve(argparse.Namespace(
                out=options.out, shape=shape, layers=int(layers) or None, mode=mode, models=options.models,
                tp=1, gpus="0", levels=options.levels, requests=options.requests, mix=options.mix,
                parity="", parity_mode="graphs", vllm_python=options.vllm_python,
            ))  # fmt: skip
            log(f"variant {variant} done")
    else:
        serve(options)


if __name__ == "__main__":
    main()
