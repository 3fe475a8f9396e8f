"""`python -m inference.sim`: vLLM's api_server flags (the ones our profiles emit) plus `--hardware`.

Unknown flags are refused as vLLM's argument parser refuses them; impossible
values and profiles vLLM would not start on the simulated GPU exit with code 1
and a vLLM-like message on stderr, before the port is bound.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from inference.errors import InputError
from inference.hardware import GPU_CATALOG, get_gpu
from inference.hf_config import resolve_model_config
from inference.sim.engine import EngineConfig, EngineRefused, SimEngine
from inference.sim.tokens import Tokenizer
from inference.vllm_args import add_knob_arguments, settings_from_args

# vLLM's --dtype spellings → the planner's.
DTYPE_ALIASES = {"half": "float16", "float": "float32", "float16": "float16", "bfloat16": "bfloat16",
                 "float32": "float32", "auto": "auto"}  # fmt: skip


# What the portal is for: a launch that names no GPU (a CPU node running the simulator)
# pretends to be on the V100s of docs/v100-field-guide.md#sources, and says so at start.
DEFAULT_HARDWARE = "v100-sxm2-32gb"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m inference.sim",
        description="A simulated vLLM OpenAI-compatible server that behaves like the GPUs it models.",
    )
    parser.add_argument(
        "--model", required=True, help="model directory, config.json, or a bundled config name"
    )
    parser.add_argument("--served-model-name", nargs="+", default=None)
    parser.add_argument(
        "--api-key", default=None, help="bearer token /v1/* wants (default: $VLLM_API_KEY; none: open)"
    )
    parser.add_argument(
        "--tokenizer", default=None, help="directory or tokenizer.json (default: the model's)"
    )
    # The profile knobs, as the portal writes them (inference/vllm_args.py); vLLM's dtype spellings.
    add_knob_arguments(parser, dtype={"choices": sorted(DTYPE_ALIASES)})
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    # Accepted and ignored, as they change nothing the simulator models.
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--disable-log-requests", action="store_true")
    parser.add_argument("--disable-log-stats", action="store_true")
    parser.add_argument("--uvicorn-log-level", default="info")
    # The simulator's own flags.
    parser.add_argument(
        "--hardware",
        default=DEFAULT_HARDWARE,
        help=f"simulated GPU (catalog key, default {DEFAULT_HARDWARE}): {', '.join(GPU_CATALOG)}",
    )
    parser.add_argument(
        "--interconnect", choices=("nvlink", "pcie"), default=None, help="default: NVLink on SXM boards"
    )
    parser.add_argument(
        "--speedup", type=float, default=1.0, help="run the simulated clock this many times faster (tests)"
    )
    return parser


def engine_from_args(args: argparse.Namespace) -> tuple[SimEngine, Tokenizer, str]:
    """The engine, tokenizer and model root for parsed flags; InputError or EngineRefused on bad input."""
    gpu = get_gpu(args.hardware)
    model = resolve_model_config(args.model)
    profile = settings_from_args(argparse.Namespace(**{**vars(args), "dtype": DTYPE_ALIASES[args.dtype]}))
    nvlink = {"nvlink": True, "pcie": False}.get(args.interconnect)
    engine = SimEngine(EngineConfig(model=model, profile=profile, gpu=gpu, nvlink=nvlink))
    source = Path(args.tokenizer or args.model)
    tokenizer_json = source if source.suffix == ".json" and source.name != "config.json" else None
    if tokenizer_json is None:
        directory = source if source.is_dir() else source.parent if source.name == "config.json" else None
        tokenizer_json = directory / "tokenizer.json" if directory is not None else None
    return engine, Tokenizer(tokenizer_json), args.model


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.speedup <= 0:
        print("ValueError: --speedup must be > 0", file=sys.stderr)
        return 1
    try:
        engine, tokenizer, root = engine_from_args(args)
    except InputError as error:
        print(f"ValueError: {error}", file=sys.stderr)
        return 1
    except EngineRefused as error:
        print(f"ValueError: {error}", file=sys.stderr)
        return 1

    from aiohttp import web

    from inference.sim.server import SimServer

    names = args.served_model_name or [args.model]
    server = SimServer(
        engine,
        served_model_names=names,
        tokenizer=tokenizer,
        model_root=root,
        speedup=args.speedup,
        # As vLLM: --api-key, else VLLM_API_KEY (the portal uses the environment, never argv).
        api_key=args.api_key or os.environ.get("VLLM_API_KEY", ""),
    )
    for warning in engine.warnings():
        print(f"WARNING inference.sim: {warning}", flush=True)
    print(f"INFO inference.sim: {engine.describe()}", flush=True)
    print(f"INFO inference.sim: serving {', '.join(names)} on http://{args.host}:{args.port}", flush=True)
    web.run_app(server.app(), host=args.host, port=args.port, print=None, access_log=None)
    return 0
