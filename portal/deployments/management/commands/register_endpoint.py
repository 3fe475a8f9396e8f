"""`manage.py register_endpoint --url http://host:port/v1 [--model NAME] [--team SLUG]`: adopt a running
vLLM server.

The portal did not start it and never stops it; it routes the model's traffic to it and
health-checks it like its own deployments. The server's `/v1/models` names the model (and its
max model length): a name the registry lacks is recorded as an external model version, from
its config.json when the server's model root is a directory here. The endpoint is checked at
once, and the command prints the state it really has.
A server started with an API key (`--api-key` / VLLM_API_KEY) is registered with
`--api-key-file <path>` ("-": stdin): never on the command line, where `ps` and shell history
would keep it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError, CommandParser

from inference import supervisor
from portal.core.errors import ApplicationError
from portal.deployments.services import endpoint_register, endpoint_url_from
from portal.deployments.tasks import check_adopted
from portal.inventory.models import Node
from portal.registry.models import ModelVersion
from portal.registry.services import model_version_create, model_version_record_external
from portal.teams.models import Team


class Command(BaseCommand):
    help = "Record a vLLM server the portal did not start, so its traffic goes through the portal."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--url", required=True, help="http://host:port/v1 (or the server root)")
        parser.add_argument(
            "--model", help="model it serves (default: the one its /v1/models lists, if only one)"
        )
        parser.add_argument("--team", help="team that owns it (default: the only team, if there is one)")
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
            base = endpoint_url_from(options["url"])
        except ApplicationError as error:
            raise CommandError(f"--url: {error.message}") from error
        team = _team(options["team"])
        node = None
        if options["node"]:
            node = Node.objects.filter(name=options["node"]).first()
            if node is None:
                raise CommandError(f"--node: no node {options['node']!r}")
        api_key = self._api_key(options["api_key_file"])
        cards = supervisor.served_model_cards(base, api_key=api_key)
        model_version = self._model_version(options["model"], cards, base)
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
        # Check now rather than leave it `pending` until a control worker's next pass.
        state = check_adopted(deployment.pk)
        deployment.refresh_from_db()
        self.stdout.write(
            f"adopted {deployment.endpoint_url} as deployment {deployment.name} ({model_version.name}) "
            f"for team {team.slug}: {state}"
            + (f" ({deployment.state_reason})" if deployment.state_reason else "")
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

    def _model_version(self, wanted: str | None, cards: list[dict] | None, base: str) -> ModelVersion:
        served = {card["id"]: card for card in cards or []}
        if wanted is None:
            if cards is None:
                raise CommandError(f"--url: {base}/v1/models does not answer; give --model to adopt it still")
            if len(served) != 1:
                listing = ", ".join(sorted(served)) or "nothing"
                raise CommandError(f"--model: the server serves {listing}; name the one to adopt")
            wanted = next(iter(served))
        version = ModelVersion.objects.filter(name=wanted).first()
        if version is not None:
            if cards is not None and wanted not in served:
                self.stderr.write(f"warning: {base}/v1/models does not list {wanted!r} ({', '.join(served)})")
            return version
        card = served.get(wanted)
        if card is None:
            raise CommandError(
                f"--model: {wanted!r} is neither registered nor listed by {base}/v1/models"
                + (f" ({', '.join(sorted(served))})" if served else "")
            )
        config = _local_config(card["root"])
        if config is not None:
            try:
                version = model_version_create(name=wanted, config=config, path=card["root"], source=base)
            except ApplicationError as error:
                self.stderr.write(f"{card['root']}/config.json: {error.message}; recording it as external")
            else:
                self.stderr.write(f"registered {wanted} from {card['root']}/config.json")
                return version
        try:
            version = model_version_record_external(
                name=wanted, max_model_len=card["max_model_len"], source=base
            )
        except ApplicationError as error:
            raise CommandError(f"--model: {error.message}") from error
        self.stderr.write(
            f"recorded {wanted} as an external model version "
            f"(max model length {card['max_model_len'] or 'unknown'})"
        )
        return version


def _team(slug: str | None) -> Team:
    if slug is not None:
        team = Team.objects.filter(slug=slug).first()
        if team is None:
            raise CommandError(f"--team: no team {slug!r}; create it with `manage.py create_team {slug}`")
        return team
    teams = list(Team.objects.order_by("slug")[:21])
    if not teams:
        raise CommandError("--team: there is no team yet; create one with `manage.py create_team <slug>`")
    if len(teams) > 1:
        listing = ", ".join(team.slug for team in teams[:20]) + (", …" if len(teams) > 20 else "")
        raise CommandError(f"--team: choose the owner: {listing}")
    return teams[0]


def _local_config(root: str | None) -> dict | None:
    """The served model's config.json when its root is a directory on this machine, else None."""
    if not root:
        return None
    path = Path(root) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None
