"""`manage.py create_team <slug> [--name "Search"] [--gpu-quota N]`: a team to own keys and deployments.

Without it a fresh install has no team until someone opens the admin (the demo data makes its own).
"""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError, CommandParser

from portal.core.errors import ApplicationError
from portal.teams.services import team_create

MAX_GPU_QUOTA = 10_000


def gpu_quota(value: str) -> int:
    number = int(value)
    if not 0 <= number <= MAX_GPU_QUOTA:
        raise ValueError(value)
    return number


class Command(BaseCommand):
    help = "Create a team (the owner of API keys and deployments)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("slug", help="short name used in URLs and commands, e.g. search")
        parser.add_argument("--name", default="", help="display name (default: the slug)")
        parser.add_argument(
            "--gpu-quota",
            type=gpu_quota,
            default=0,
            help=f"GPUs its running deployments may hold at once, 0 to {MAX_GPU_QUOTA} (default: 0)",
        )

    def handle(self, *args, **options) -> None:
        try:
            team = team_create(slug=options["slug"], name=options["name"], gpu_quota=options["gpu_quota"])
        except ApplicationError as error:
            flag = {"slug": "slug", "name": "--name", "gpu_quota": "--gpu-quota"}.get(error.field, "slug")
            raise CommandError(f"{flag}: {error.message}") from error
        self.stdout.write(f"created team {team.slug} ({team.name}), GPU quota {team.gpu_quota}")
