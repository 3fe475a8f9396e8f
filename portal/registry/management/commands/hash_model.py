"""`manage.py hash_model <dir>`: SHA-256 of a model's weights and tokenizer files."""

from __future__ import annotations

import json
import sys

from django.core.management.base import BaseCommand, CommandError, CommandParser

from inference.errors import InputError
from inference.hashing import hash_model_dir
from portal.registry.models import ModelVersion
from portal.registry.services import model_version_record_hashes


class Command(BaseCommand):
    help = "Hash a model directory's weight files and tokenizer files (streamed), optionally recording them."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("path", help="model directory")
        parser.add_argument("--model", help="record the hashes on this registered model version")
        parser.add_argument("--json", action="store_true", help="print JSON (with per-file digests)")

    def handle(self, *args, **options) -> None:
        version = None
        if options["model"]:
            version = ModelVersion.objects.filter(name=options["model"]).first()
            if version is None:
                raise CommandError(f"--model: no registered model version '{options['model']}'")
        try:
            hashes = hash_model_dir(options["path"], progress=self._progress)
        except InputError as error:
            raise CommandError(str(error)) from error
        if version is not None:
            model_version_record_hashes(model_version=version, hashes=hashes)
        if options["json"]:
            self.stdout.write(json.dumps(hashes.to_dict(), indent=2))
            return
        self.stdout.write(f"weights   sha256 {hashes.weights_sha256}  ({len(hashes.weight_files)} files)")
        tokenizer = hashes.tokenizer_sha256 or "(no tokenizer files)"
        self.stdout.write(f"tokenizer sha256 {tokenizer}  ({len(hashes.tokenizer_files)} files)")
        if version is not None:
            self.stdout.write(f"recorded on model version {version.name}")
        if not hashes.tokenizer_sha256:
            # Recorded or not, a version without a tokenizer hash cannot be rolled out: say so now
            # rather than at the rollout's start.
            self.stderr.write(
                f"warning: no tokenizer files in {options['path']} (tokenizer.json, tokenizer.model, …): "
                "a rollout needs release hashes of both the weights and the tokenizer"
            )

    def _progress(self, name: str, done: int, total: int) -> None:
        # Progress goes to stderr so stdout stays clean for --json.
        if sys.stderr.isatty():
            percent = 100 * done / total if total else 100
            sys.stderr.write(f"\r{percent:5.1f}%  {name[:60]:<60}")
            if done >= total:
                sys.stderr.write("\n")
