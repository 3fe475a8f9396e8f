"""`manage.py plan`: the capacity planner from the shell (contract: docs/architecture.md#contracts)."""

from __future__ import annotations

import json

from django.core.management.base import BaseCommand, CommandError, CommandParser

from inference.hardware import get_gpu
from inference.planner import Plan
from inference.profile import launch_knobs
from inference.vllm_args import add_knob_arguments, knob_options
from portal.core.errors import ApplicationError
from portal.deployments.services import plan_on_catalog_gpus


class Command(BaseCommand):
    help = "Plan a model on GPUs: weights per GPU, KV-cache capacity, decode ceiling and findings."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--gpu", required=True, help="GPU catalog name, e.g. v100-sxm2-32gb")
        parser.add_argument("--gpus", type=int, required=True, help="how many GPUs")
        parser.add_argument(
            "--model", required=True, help="registered model name, bundled config, or config.json path"
        )
        # Every launch knob by its vLLM flag, with the profile's defaults (inference/profile.py);
        # the tensor-parallel size is also `--tp` and defaults to all the GPUs (docs/architecture.md).
        add_knob_arguments(
            parser,
            portal_defaults=True,
            dtype={"help": "float16 | bfloat16 | float32 | auto"},
            quantization={"help": "gptq | awq | fp8 … (default: from the model)"},
            block_size={"choices": None},  # the planner refuses a bad one, naming --block-size
            tensor_parallel_size={
                "flags": ("--tp", "--tensor-parallel-size"),
                "default": None,
                "help": "tensor-parallel size (default: --gpus)",
            },
        )
        link = parser.add_mutually_exclusive_group()
        link.add_argument(
            "--nvlink", dest="nvlink", action="store_true", default=None, help="GPUs are NVLinked"
        )
        link.add_argument("--pcie", dest="nvlink", action="store_false", help="GPUs talk over PCIe only")
        parser.add_argument(
            "--engine-version",
            default="",
            help="the node's vLLM version, e.g. 0.19.1 or 0.8.5 (default: the newest line)",
        )
        parser.add_argument("--json", action="store_true", help="print JSON instead of a table")

    def handle(self, *args, **options) -> None:
        try:
            plan = plan_on_catalog_gpus(
                model=options["model"],
                gpu=options["gpu"],
                gpus=options["gpus"],
                nvlink=options["nvlink"],
                allow_paths=True,
                engine_version=options["engine_version"],
                **knob_options(options),
            )
        except ApplicationError as error:
            raise CommandError(
                f"{_flag(error.field)}: {error.message}" if error.field else error.message
            ) from error
        if options["json"]:
            self.stdout.write(json.dumps(plan.to_dict(), indent=2))
        else:
            self.stdout.write(
                render_plan(
                    plan,
                    title=f"{options['model']} on {options['gpus']} × {get_gpu(plan.gpu_key).display_name}",
                )
            )


def _flag(field: str) -> str:
    """The command-line flag for a settings field, so errors name what the user typed."""
    flags = {spec.name: knob.flag for spec, knob in launch_knobs()} | {"tensor_parallel_size": "--tp"}
    return flags.get(field, "--" + field.replace("_", "-"))


def render_plan(plan: Plan, *, title: str) -> str:
    data = plan.to_dict()
    rows = [
        ("weights in all", f"{data['weights_gb_total']:.2f} GB"),
        ("weights per GPU", f"{data['weights_gb_per_gpu']:.2f} GB"),
        ("KV cache per GPU", f"{data['kv_cache_gb_per_gpu']:.2f} GB"),
        ("KV cache capacity", f"{data['kv_cache_tokens']} tokens"),
        ("max model length", f"{data['max_model_len']}"),
        ("sequences at max length", f"{data['max_concurrent_seqs_at_max_len']}"),
        ("one-stream decode ceiling", f"{data['decode_tokens_per_s_ceiling']:.1f} tokens/s"),
        ("decode step (effective bw)", f"{data['decode_step_ms_at_effective_bandwidth']:.2f} ms"),
        ("prefill 1k tokens ideal", f"{data['prefill_ms_per_1k_tokens_ideal']:.1f} ms"),
        ("prefill 1k tokens expected", f"{data['prefill_ms_per_1k_tokens_expected']:.1f} ms"),
    ]
    width = max(len(label) for label, _ in rows)
    lines = [title, "=" * len(title)]
    lines += [f"{label:<{width}}  {value:>18}" for label, value in rows]
    lines.append("")
    lines.append("findings:" if data["findings"] else "findings: none")
    for finding in data["findings"]:
        lines.append(f"  {finding['level']:<8} {finding['code']:<32} {finding['message']}")
    lines.append("")
    lines.append("verdict: OK" if data["ok"] else "verdict: REFUSED (see the errors above)")
    return "\n".join(lines)
