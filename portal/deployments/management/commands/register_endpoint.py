"""`manage.py register_endpoint --model <name> --url http://host:port/v1`: adopt a running vLLM server.

The portal did not start it and never stops it; it routes the model's traffic to
it and health-checks it like its own deployments. A server started with an API key
(`--api-key` / VLLM_API_KEY) is registered with `--api-key-file <path>` ("-": stdin):
never on the command line, where `ps` and shell history would keep it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError, CommandParser

from portal.core.errors import ApplicationError
from portal.deployments.services import endpoint_register
from portal.inventory.models import Node
from portal.registry.models import ModelVersion
from portal.teams.models import Team


class Command(BaseCommand):
    help = "Record a vLLM server the portal did not start, so its traffic goes through the portal."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--model", required=True, help="registered model version it serves")
        parser.add_argument("--url", required=True, help="http://host:port/v1 (or the server root)")
        parser.add_argument("--team", default="platform", help="team that owns it (default: platform)")
        parser.add_argument("--name", help="deployment name (default: <model>-adopted)")
        parser.add_argument("--node", help="node it runs on, if the inventory has it")
        parser.add_argument(
            "--shared", action="store_true", help="every team's keys may call it (default: its team's only)"
        )
        parser.add_argument(
            "--api-key-file",
            help="file holding the key the server wants as a bearer token ('-': read it from stdin)",
        )

    def handle(self, *args, **options) -> None:
        try:
            model_version = ModelVersion.objects.get(name=options["model"])
        except ModelVersion.DoesNotExist as error:
            raise CommandError(
                f"--model: no model version named {options['model']!r}; register it first "
                "(manage.py register_model)"
            ) from error
        try:
            team = Team.objects.get(slug=options["team"])
        except Team.DoesNotExist as error:
            raise CommandError(f"--team: no team {options['team']!r}") from error
        node = None
        if options["node"]:
            node = Node.objects.filter(name=options["node"]).first()
            if node is None:
                raise CommandError(f"--node: no node {options['node']!r}")
        api_key = self._api_key(options["api_key_file"])
        name = options["name"] or f"{model_version.name.replace('.', '-')}-adopted"[:100]
        try:
            deployment = endpoint_register(
                name=name,
                team=team,
                model_version=model_version,
                url=options["url"],
                node=node,
                shared=options["shared"],
                api_key=api_key,
            )
        except ApplicationError as error:
            field = "api-key-file" if error.field == "api_key" else error.field or "url"
            raise CommandError(f"--{field}: {error.message}") from error
        self.stdout.write(
            f"adopted {deployment.endpoint_url} as deployment {deployment.name} serving {model_version.name}"
        )

    def _api_key(self, path: str | None) -> str:
        if not path:
            return ""
        try:
            text = sys.stdin.read(4096) if path == "-" else Path(path).read_text(encoding="utf-8")[:4096]
        except (OSError, UnicodeDecodeError) as error:
            raise CommandError(f"--api-key-file: cannot read {path}: {error}") from error
        if not text.strip():
            raise CommandError(f"--api-key-file: {path} is empty")
        return text.strip()
