"""The `bench` command (its contract: docs/architecture.md#contracts).

    python manage.py bench --url … --model … --concurrency 16,32 --requests-per-level N \
        --mix <name> [--json out.json]


The same load generator and statistics as the Celery job (inference.loadgen); no database needed.
"""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from inference.errors import InputError
from inference.loadgen import cli


class Command(BaseCommand):
    help = "Benchmark an OpenAI-compatible server at fixed concurrency levels and print the per-level table."

    def add_arguments(self, parser) -> None:
        cli.add_arguments(parser)

    def handle(self, *args, **options) -> None:
        try:
            cli.run(options, out=self.stdout)
        except InputError as error:
            raise CommandError(str(error)) from error
