"""`manage.py simulate`: predict a concurrency sweep with the simulator's virtual clock.

Takes `plan`'s flags (GPU, count, model, TP, dtype, quantization, max model
length, memory fraction, max sequences, block size, eager, NVLink/PCIe) plus the
rest of the profile (batched tokens, prefix caching, chunked prefill) and the
workload (`--mix`, `--concurrency`, `--requests-per-level`). Prints the
benchmark's per-level table and the SLA operating point, or with `--json`
{"levels": [...], "sla_concurrency": N, "calibration": {name: seconds}}.

The host-side costs are the uncalibrated defaults unless `--calibration FILE` applies a
saved calibration (the "calibration" object of an earlier `--json`), or
`--calibrate-from FILE` fits one to a `manage.py bench --json` report measured with the
same profile and workload (on all its levels, or those of `--fit-levels`). Given both,
the saved calibration is where the fit starts. `--node NAME` applies the calibration of
the node's latest acceptance instead of a file.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError, CommandParser

from inference.loadgen.summary import format_table
from inference.sim.costs import describe_calibration
from portal.core.errors import ApplicationError
from portal.deployments.management.commands.plan import Command as PlanCommand
from portal.deployments.management.commands.plan import _flag
from portal.deployments.predict import calibrate_sweep, node_calibration, parse_concurrency, predict_sweep


def _read_json(path: str, flag: str) -> object:
    try:
        return json.loads(Path(path).read_text())
    except OSError as error:
        raise CommandError(f"{flag}: cannot read {path}: {error.strerror or error}") from error
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CommandError(f"{flag}: {path} is not JSON ({error})") from error


class Command(BaseCommand):
    help = "Simulate a closed-loop concurrency sweep of a profile (virtual clock: seconds of wall time)."

    def add_arguments(self, parser: CommandParser) -> None:
        PlanCommand.add_arguments(self, parser)  # plan's flags, including --json
        parser.add_argument("--max-num-batched-tokens", type=int, default=None)
        parser.add_argument("--enable-prefix-caching", action="store_true")
        parser.add_argument("--enable-chunked-prefill", action="store_true")
        parser.add_argument(
            "--mix", default="field-mix", help="field-mix | short-qa | long-summary | qa-summary-60-40 | "
            "prefix-shared | fixed:<in>:<out> | path to a mix JSON file",
        )  # fmt: skip
        parser.add_argument("--concurrency", default="16,32,64,128,256", help="comma-separated levels")
        parser.add_argument(
            "--requests-per-level",
            type=int,
            default=None,
            help="measured requests per level (default: 20 per user)",
        )
        parser.add_argument("--seed", type=int, default=0, help="workload sampling seed")
        parser.add_argument(
            "--calibrate-from",
            default=None,
            metavar="BENCH_JSON",
            help="fit the node's host costs to this `manage.py bench --json` report (same profile and mix)",
        )
        parser.add_argument(
            "--fit-levels", default=None, help="with --calibrate-from: fit on these levels only, e.g. 1,16"
        )
        parser.add_argument(
            "--calibration",
            default=None,
            metavar="JSON",
            help='apply a saved calibration: the "calibration" object of an earlier --json',
        )
        parser.add_argument(
            "--node", default=None, help="apply the calibration of this node's latest acceptance"
        )

    def handle(self, *args, **options) -> None:
        started = time.perf_counter()
        calibration = None
        if options["calibration"] and options["node"]:
            raise CommandError("--node: give either --node or --calibration")
        if options["calibration"]:
            calibration = _read_json(options["calibration"], "--calibration")
        elif options["node"]:
            try:
                calibration = node_calibration(options["node"])
            except ApplicationError as error:
                raise CommandError(f"--node: {error.message}") from error
            if calibration is None:
                self.stderr.write(f"node {options['node']} has no acceptance calibration: uncalibrated")
        fit_levels = None
        if options["fit_levels"]:
            if not options["calibrate_from"]:
                raise CommandError("--fit-levels: give it with --calibrate-from")
            try:
                fit_levels = parse_concurrency(options["fit_levels"])
            except ApplicationError as error:
                raise CommandError(f"--fit-levels: {error.message}") from error
        kwargs = dict(
            model=options["model"],
            gpu=options["gpu"],
            gpus=options["gpus"],
            mix=options["mix"],
            nvlink=options["nvlink"],
            allow_paths=True,
            requests_per_level=options["requests_per_level"],
            seed=options["seed"],
            calibration=calibration,
            dtype=options["dtype"],
            tensor_parallel_size=options["tp"],
            max_model_len=options["max_model_len"],
            gpu_memory_utilization=options["gpu_memory_utilization"],
            max_num_seqs=options["max_num_seqs"],
            max_num_batched_tokens=options["max_num_batched_tokens"],
            block_size=options["block_size"],
            enforce_eager=options["enforce_eager"],
            enable_prefix_caching=options["enable_prefix_caching"],
            enable_chunked_prefill=options["enable_chunked_prefill"],
            quantization=options["quantization"],
        )
        try:
            kwargs["concurrency"] = parse_concurrency(options["concurrency"])
            if options["calibrate_from"]:
                measured = _read_json(options["calibrate_from"], "--calibrate-from")
                result = calibrate_sweep(measured=measured, fit_levels=fit_levels, **kwargs)
            else:
                result = predict_sweep(**kwargs)
        except ApplicationError as error:
            raise CommandError(
                f"{_flag(error.field)}: {error.message}" if error.field else error.message
            ) from error
        if options["json"]:
            self.stdout.write(
                json.dumps(
                    {
                        "levels": result["levels"],
                        "sla_concurrency": result["sla_concurrency"],
                        "calibration": result["calibration"],
                    },
                    indent=2,
                )
            )
            return
        if "fit" in result:
            self.stdout.write("fitted on the measured levels (output tok/s, mean TPOT ms, mean TTFT ms):")
            for level in result["fit"]["levels"]:
                ttft, predicted_ttft = level.get("measured_mean_ttft_ms"), level.get("predicted_mean_ttft_ms")
                self.stdout.write(
                    f"  {level['concurrency']:>4} users: measured {level['measured_output_throughput']:.1f}, "
                    f"{level['measured_mean_tpot_ms']:.2f}, {ttft or 0:.1f}; predicted "
                    f"{level['predicted_output_throughput'] or 0:.1f}, "
                    f"{level['predicted_mean_tpot_ms'] or 0:.2f}, {predicted_ttft or 0:.1f}"
                )
        calibrated = "fitted" if "fit" in result else ("saved" if calibration is not None else "uncalibrated")
        if options["node"] and calibration is not None and "fit" not in result:
            calibrated = f"node {options['node']}'s acceptance"
        self.stdout.write(f"host costs ({calibrated}): " + describe_calibration(result["calibration"]))
        self.stdout.write(format_table(result["levels"]))
        self.stdout.write("")
        self.stdout.write(
            f"SLA operating point: {result['sla_concurrency'] or 'none'} ({result['sla_reason']})"
        )
        self.stdout.write(f"simulated in {time.perf_counter() - started:.1f} s of wall time")
