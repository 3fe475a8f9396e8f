"""`manage.py create_key --team <slug> --models a,b [--rpm N --tpm N --tokens-per-day N --max-concurrent N]
[--priority-class interactive|batch]`

Prints the new key once (stdout, nothing else on that line); it is not stored and cannot be shown again.
"""

from __future__ import annotations

import datetime as dt

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from portal.core.errors import ApplicationError
from portal.teams.models import Team
from portal.teams.services import api_key_create


def positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise ValueError(value)
    return number


class Command(BaseCommand):
    help = "Create an API key for a team and print it once."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--team", required=True, help="Team slug.")
        parser.add_argument(
            "--models", default="", help="Comma-separated model names (blank: the team's models)."
        )
        parser.add_argument("--name", default="", help="What the key is for.")
        parser.add_argument("--rpm", type=positive, help="Requests per minute for this key.")
        parser.add_argument("--tpm", type=positive, help="Tokens per minute for this key.")
        parser.add_argument("--tokens-per-day", type=positive, help="Tokens per UTC day for this key.")
        parser.add_argument(
            "--max-concurrent", type=positive, help="Requests in flight at once for this key."
        )
        parser.add_argument(
            "--priority-class",
            choices=["interactive", "batch"],
            default="",
            help="How the gateway admits this key's requests (default: the team's class).",
        )
        parser.add_argument("--expires-in-days", type=positive, help="Expire the key after this many days.")

    def handle(self, *args, **options) -> None:
        team = Team.objects.filter(slug=options["team"]).first()
        if team is None:
            raise CommandError(f"--team: no team with slug {options['team']!r}")
        days = options.get("expires_in_days")
        try:
            key, token = api_key_create(
                team=team,
                name=options["name"],
                allowed_models=options["models"].split(","),
                expires_at=timezone.now() + dt.timedelta(days=days) if days else None,
                rpm_limit=options.get("rpm"),
                tpm_limit=options.get("tpm"),
                tokens_per_day=options.get("tokens_per_day"),
                max_concurrent=options.get("max_concurrent"),
                priority_class=options.get("priority_class") or "",
            )
        except ApplicationError as error:
            raise CommandError(f"--{error.field.replace('_', '-')}: {error.message}") from error
        self.stderr.write(f"Created key sk-{key.prefix}… for team {team.slug}; it is shown once, now:")
        self.stdout.write(token)
