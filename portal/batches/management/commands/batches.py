"""`manage.py batches pause|resume|status`: staff's switch for all batch work during an incident."""

from __future__ import annotations

from django.core.management.base import BaseCommand

from portal.batches.selectors import batches_paused
from portal.batches.services import batches_pause_set


class Command(BaseCommand):
    help = "Pause or resume all batch work (lines in flight finish), or show whether it is paused."

    def add_arguments(self, parser) -> None:
        parser.add_argument("action", choices=["pause", "resume", "status"])

    def handle(self, *args, action: str, **options) -> None:
        if action != "status":
            batches_pause_set(paused=action == "pause", by="manage.py batches")
        self.stdout.write("paused" if batches_paused() else "running")
