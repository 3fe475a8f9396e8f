"""`manage.py convert_bf16 --model <name>`: a bf16 model version → a new fp16 version, here and now."""

from __future__ import annotations

import sys
import time

from django.core.management.base import BaseCommand, CommandError, CommandParser

from inference.convert import ConversionProgress
from portal.core.errors import ApplicationError
from portal.registry.models import ConversionState, ModelVersion
from portal.registry.services import conversion_job_run, conversion_job_start


class Command(BaseCommand):
    help = (
        "Convert a bf16 model version's safetensors to fp16 on this machine and register the copy as a "
        "new model version (the same job the portal sends to a node agent, run synchronously)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--model", required=True, help="the bf16 model version to convert")
        parser.add_argument("--clamp", action="store_true", help="set values beyond ±65504 to ±65504")
        parser.add_argument("--name", default="", help="name of the new version (default: <model>-fp16)")
        parser.add_argument("--output", default="", help="output directory (default: beside the source)")

    def handle(self, *args, **options) -> None:
        version = ModelVersion.objects.filter(name=options["model"]).first()
        if version is None:
            raise CommandError(f"--model: no registered model version '{options['model']}'")
        flags = {"model_version": "--model", "name": "--name", "output": "--output", "path": "--model"}
        try:
            job = conversion_job_start(
                model_version=version,
                new_name=options["name"],
                output_path=options["output"],
                clamp=options["clamp"],
            )
        except ApplicationError as error:
            raise CommandError(f"{flags.get(error.field, error.field)}: {error.message}") from error
        self.stdout.write(f"conversion job {job.pk}: {version.name} → {job.new_name} in {job.output_path}")
        self._last = 0.0
        job = conversion_job_run(job_id=job.pk, progress=self._progress)
        if sys.stderr.isatty():
            sys.stderr.write("\n")
        report = job.report
        if report:
            self.stdout.write(
                f"{report['tensors_total']} tensors ({report['tensors_converted']} bf16 → fp16, "
                f"{report['tensors_copied']} copied), {report['bytes_total'] / 1e6:.1f} MB "
                f"in {report['seconds']:.1f} s ({report['mb_per_s']:.0f} MB/s)"
            )
        for overflow in job.overflows:
            verb = "clamped" if job.clamp else "would overflow"
            self.stdout.write(
                f"  {verb}: {overflow['file']}:{overflow['tensor']} {overflow['count']} values "
                f"(max |x| {overflow['max_abs']:g})"
            )
        if job.nonfinite_total:
            self.stdout.write(f"  {job.nonfinite_total} NaN/inf values kept as they are")
        if job.underflow_total:
            self.stdout.write(f"  {job.underflow_total} nonzero values below 2**-25 became zero")
        if job.state != ConversionState.SUCCEEDED:
            raise CommandError(f"conversion job {job.pk} failed: {job.error}")
        result = job.result
        assert result is not None  # a succeeded job registered its model
        self.stdout.write(
            f"registered {result.name} at {result.path} "
            f"(weights sha256 {result.weights_sha256[:12]}, "
            f"tokenizer {result.tokenizer_sha256[:12] or '—'})"
        )

    def _progress(self, p: ConversionProgress) -> None:
        now = time.monotonic()
        if now - self._last < 0.5 and p.bytes_done < p.bytes_total:
            return
        self._last = now
        percent = 100 * p.bytes_done / p.bytes_total if p.bytes_total else 100
        line = (
            f"{percent:5.1f}%  {p.tensors_done}/{p.tensors_total} tensors  "
            f"{p.bytes_done / 1e6:.0f}/{p.bytes_total / 1e6:.0f} MB  {p.file[:50]}"
        )
        # Progress on stderr, like hash_model: stdout carries the report.
        if sys.stderr.isatty():
            sys.stderr.write(f"\r{line:<100}")
        else:
            self.stderr.write(line)
