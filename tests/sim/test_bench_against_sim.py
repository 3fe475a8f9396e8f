"""The benchmark's load generator, run against the simulated server, measures what the
virtual clock predicts: the real-time server and the sweep share one engine."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestServer

from inference.loadgen.loadgen import BenchConfig, LevelPlan, run_sweep
from inference.loadgen.workloads import load_mix
from inference.sim.cli import build_parser, engine_from_args
from inference.sim.server import SimServer
from inference.sim.virtual import run_level

# Slow enough that the event loop's own work (a fraction of a millisecond per step on a
# busy machine) stays small next to each simulated step.
SPEEDUP = 2.0
ARGV = [
    "--model", "llama-2-7b-chat-hf", "--hardware", "v100-sxm2-32gb", "--tensor-parallel-size", "8",
    "--dtype", "float16", "--max-model-len", "4096", "--enable-chunked-prefill", "--enforce-eager",
]  # fmt: skip


def test_it_measures_through_the_benchmark_what_the_virtual_clock_predicts():
    mix = load_mix("fixed:400:40")
    concurrency, requests = 4, 24

    async def measure() -> dict:
        engine, tokenizer, root = engine_from_args(build_parser().parse_args(ARGV))
        server = SimServer(
            engine, served_model_names=["llama"], tokenizer=tokenizer, model_root=root, speedup=SPEEDUP
        )
        async with TestServer(server.app()) as http:
            config = BenchConfig(
                base_url=str(http.make_url("/")),
                model="llama",
                mix=mix,
                levels=[LevelPlan(concurrency=concurrency, requests=requests)],
                scrape_interval_s=0.2,
            )
            result = await run_sweep(config)
        return result.levels[0]

    measured = asyncio.run(measure())
    engine_args = build_parser().parse_args(ARGV)
    engine, _, _ = engine_from_args(engine_args)
    predicted = run_level(
        engine.config, mix.sample(requests + concurrency), concurrency=concurrency, warmup=concurrency
    ).level
    assert measured["failed"] == 0
    assert measured["completed"] == requests
    # Wall-clock seconds are simulated seconds ÷ SPEEDUP.
    assert measured["output_throughput"] / SPEEDUP == pytest.approx(predicted["output_throughput"], rel=0.25)
    assert measured["mean_tpot_ms"] * SPEEDUP == pytest.approx(predicted["mean_tpot_ms"], rel=0.25)
