"""`manage.py register_model`: register a model version from its config.json."""

from __future__ import annotations

import json
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from portal.core.errors import ApplicationError
from portal.registry.services import model_version_create, model_version_hash_files


class Command(BaseCommand):
    help = "Register a model version: facts from its config.json; --hash also records the release hashes."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--name", required=True, help="served model name")
        parser.add_argument("--path", required=True, help="model directory (holding config.json)")
        parser.add_argument("--source", default="")
        parser.add_argument("--hash", action="store_true", help="hash the weights and tokenizer now")

    def handle(self, *args, **options) -> None:
        config_path = Path(options["path"]) / "config.json"
        try:
            config = json.loads(config_path.read_text())
        except FileNotFoundError as error:
            raise CommandError(f"--path: no config.json in {options['path']}") from error
        except json.JSONDecodeError as error:
            raise CommandError(f"--path: {config_path} is not valid JSON: {error}") from error
        try:
            with transaction.atomic():  # registered with its hashes, or not at all
                version = model_version_create(
                    name=options["name"],
                    config=config,
                    path=str(Path(options["path"]).resolve()),
                    source=options["source"],
                )
                if options["hash"]:
                    model_version_hash_files(model_version=version)
        except ApplicationError as error:
            raise CommandError(f"{error.field}: {error.message}" if error.field else error.message) from error
        self.stdout.write(
            f"registered {version.name}: {version.params_display} parameters, {version.weight_dtype}"
        )
