"""`manage.py simulate`: predict a concurrency sweep with the simulator's virtual clock.

Takes `plan`'s flags (GPU, count, model, TP, dtype, quantization, max model
length, memory fraction, max sequences, block size, eager, NVLink/PCIe) plus the
rest of the profile (batched tokens, prefix caching, chunked prefill) and the
workload (`--mix`, `--concurrency`, `--requests-per-level`). Prints the
benchmark's per-level table and the SLA operating point, or with `--json`
{"levels": [...], "sla_concurrency": N}.
"""

from __future__ import annotations

import json
import time

from django.core.management.base import BaseCommand, CommandError, CommandParser

from inference.bench.metrics import format_table
from portal.core.errors import ApplicationError
from portal.deployments.management.commands.plan import Command as PlanCommand
from portal.deployments.management.commands.plan import _flag
from portal.deployments.predict import parse_concurrency, predict_sweep


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

    def handle(self, *args, **options) -> None:
        started = time.perf_counter()
        try:
            result = predict_sweep(
                model=options["model"],
                gpu=options["gpu"],
                gpus=options["gpus"],
                mix=options["mix"],
                concurrency=parse_concurrency(options["concurrency"]),
                nvlink=options["nvlink"],
                allow_paths=True,
                requests_per_level=options["requests_per_level"],
                seed=options["seed"],
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
        except ApplicationError as error:
            raise CommandError(
                f"{_flag(error.field)}: {error.message}" if error.field else error.message
            ) from error
        if options["json"]:
            self.stdout.write(
                json.dumps(
                    {"levels": result["levels"], "sla_concurrency": result["sla_concurrency"]}, indent=2
                )
            )
            return
        self.stdout.write(format_table(result["levels"]))
        self.stdout.write("")
        self.stdout.write(
            f"SLA operating point: {result['sla_concurrency'] or 'none'} ({result['sla_reason']})"
        )
        self.stdout.write(f"simulated in {time.perf_counter() - started:.1f} s of wall time")
