"""`manage.py accept_node <node>`: accept ("burn in") a node, here or through its agent.

Run on the node itself, it does the work in this process and prints each step as it happens;
with --agent it asks the node's agent (as the node page's button does) and follows the record.
Exit status: 0 passed, 2 slower than predicted, 1 failed.
"""

from __future__ import annotations

import json
import time

from django.core.management.base import BaseCommand, CommandError, CommandParser

from inference.tiny_model import TINY_SHAPE, shape_names
from portal.benchmarks.acceptance.options import DEFAULT_CONCURRENCY, DEFAULT_MIX, DEFAULT_SHAPE
from portal.benchmarks.acceptance.request import node_acceptance_request
from portal.benchmarks.acceptance.run import node_acceptance_run
from portal.core.errors import ApplicationError
from portal.inventory.models import AcceptanceState, Node, NodeAcceptance


def _num(value, fmt: str = "{:.1f}") -> str:
    return fmt.format(value) if value is not None else "—"


class Command(BaseCommand):
    help = (
        "Accept a node: discover its GPUs, start a reference model in a chosen shape through the "
        "deployment lifecycle, benchmark it, compare with the simulator and fit the node's calibration."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("node", help="node name")
        parser.add_argument(
            "--shape",
            default=None,
            help=f"{' | '.join(shape_names())} (default: {DEFAULT_SHAPE}; {TINY_SHAPE} on a CPU-only node)",
        )
        parser.add_argument("--layers", type=int, default=None, help="override the shape's layer count")
        parser.add_argument(
            "--concurrency",
            default=",".join(map(str, DEFAULT_CONCURRENCY)),
            help="2 to 4 closed-loop levels, e.g. 1,16,64",
        )
        parser.add_argument("--mix", default=DEFAULT_MIX, help="bench workload (preset or fixed:<in>:<out>)")
        parser.add_argument("--requests-per-level", type=int, default=None, help="default: 4 per user, ≥ 8")
        parser.add_argument("--eager", action="store_true", help="--enforce-eager (default: CUDA graphs)")
        parser.add_argument(
            "--max-model-len", type=int, default=None, help="the reference server's (default: 4096, capped)"
        )
        parser.add_argument("--gpu-index", type=int, default=None, help="GPU to use (default: the first)")
        parser.add_argument(
            "--predict-gpu", default="", help="GPU catalog key to predict for (default: the node's GPU)"
        )
        parser.add_argument(
            "--profile",
            default=None,
            help="a deployment profile: launch the reference model with its vLLM flags (chunked prefill, "
            "prefix caching, token budget, max_model_len, block size, eager, …) and, when it turns on "
            "chunked prefill or prefix caching, probe them (vllm#2729, vllm#3687 on Volta)",
        )
        parser.add_argument("--agent", action="store_true", help="run it on the node's agent and follow it")
        parser.add_argument("--json", dest="json_path", default=None, help="write the record here")

    def handle(self, *args, **options) -> None:
        node = Node.objects.filter(name=options["node"]).first()
        if node is None:
            raise CommandError(f"node: no node named {options['node']!r}")
        try:
            acceptance = node_acceptance_request(
                node=node,
                shape=options["shape"],
                layers=options["layers"],
                enforce_eager=options["eager"],
                mix=options["mix"],
                concurrency=options["concurrency"],
                requests_per_level=options["requests_per_level"],
                gpu_index=options["gpu_index"],
                predict_gpu=options["predict_gpu"],
                profile=options["profile"],
                max_model_len=options["max_model_len"],
                send=options["agent"],
            )
        except ApplicationError as error:
            raise CommandError(f"{error.field}: {error.message}" if error.field else error.message) from error
        with_profile = f", the flags of profile {acceptance.profile_name}" if acceptance.profile_name else ""
        self.stdout.write(
            f"acceptance {acceptance.pk} of {node.name}: {acceptance.shape}, {acceptance.mix}{with_profile}"
        )
        if options["agent"]:
            acceptance = self._follow(acceptance)
        else:
            acceptance = node_acceptance_run(acceptance_id=acceptance.pk, on_progress=self._say)
        self._report(acceptance)
        if options["json_path"]:
            with open(options["json_path"], "w") as out:
                json.dump(record_dict(acceptance), out, indent=2)
        if acceptance.state == AcceptanceState.FAILED:
            raise CommandError(f"failed at {acceptance.error}")
        if acceptance.state == AcceptanceState.SLOW:
            raise CommandError(acceptance.verdict, returncode=2)

    def _say(self, entry: dict) -> None:
        seconds = f" ({entry['seconds']:.1f} s)" if entry.get("seconds") is not None else ""
        self.stdout.write(f"{entry['step']:>9} {entry['status']:<7} {entry['message']}{seconds}")

    def _follow(self, acceptance: NodeAcceptance) -> NodeAcceptance:
        shown = 0
        while True:
            acceptance.refresh_from_db()
            for entry in acceptance.progress[shown:]:
                self._say(entry)
            shown = len(acceptance.progress)
            if acceptance.finished:
                return acceptance
            time.sleep(2)

    def _report(self, acceptance: NodeAcceptance) -> None:
        self.stdout.write("")
        self.stdout.write(
            "users | measured tok/s | predicted | calibrated | ratio"
            " | measured TPOT ms | predicted | calibrated | measured TTFT ms | predicted | calibrated"
        )
        for row in acceptance.levels:
            measured, predicted = row["measured"], row.get("predicted") or {}
            calibrated = row.get("calibrated") or {}
            self.stdout.write(
                " | ".join(
                    [
                        f"{row['concurrency']:>5}",
                        _num(measured.get("output_throughput")),
                        _num(predicted.get("output_throughput")),
                        _num(calibrated.get("output_throughput")),
                        _num(row.get("output_throughput_ratio"), "{:.2f}"),
                        _num(measured.get("mean_tpot_ms")),
                        _num(predicted.get("mean_tpot_ms")),
                        _num(calibrated.get("mean_tpot_ms")),
                        _num(measured.get("mean_ttft_ms")),
                        _num(predicted.get("mean_ttft_ms")),
                        _num(calibrated.get("mean_ttft_ms")),
                    ]
                )
            )
        self.stdout.write(f"engine start: {_num(acceptance.engine_start_s)} s")
        if acceptance.calibration:
            self.stdout.write(f"calibration: {json.dumps(acceptance.calibration)}")
        self.stdout.write(f"versions: {json.dumps(acceptance.versions)}")
        self.stdout.write(f"{acceptance.state.upper()}: {acceptance.verdict or acceptance.error}")


def record_dict(acceptance: NodeAcceptance) -> dict:
    """The record as JSON (docs/gpu-runs.md keeps these)."""
    fields = [
        "state", "shape", "layers", "dtype", "enforce_eager", "mix", "concurrency", "requests_per_level",
        "gpu_indices", "predict_gpu", "profile_name", "profile_flags", "margin", "deployment_name",
        "model_name", "levels", "measured",
        "engine_start_s", "calibration", "versions", "verdict", "error", "progress",
    ]  # fmt: skip
    data = {name: getattr(acceptance, name) for name in fields}
    data |= {"id": acceptance.pk, "node": acceptance.node.name}
    data |= {"started_at": str(acceptance.started_at), "finished_at": str(acceptance.finished_at)}
    return data
