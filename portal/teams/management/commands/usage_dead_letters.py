"""`manage.py usage_dead_letters [--show N] [--replay | --purge]`

Usage records the flush could not store (docs/operators.md, Day-2 operations): how many, why, the newest ones;
`--replay` puts them back on the queue for the next flush (all but those of days retention has
closed, which it names and leaves), `--purge` forgets them.
"""

from __future__ import annotations

import datetime as dt

from django.core.management.base import BaseCommand, CommandError

from portal.teams.selectors import usage_dead_letters
from portal.teams.services import usage_dead_letters_purge, usage_dead_letters_replay


def bounded(value: str) -> int:
    number = int(value)
    if not 0 <= number <= 1000:
        raise ValueError(value)
    return number


class Command(BaseCommand):
    help = "Show, replay or purge the usage records the flush dead-lettered."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--show", type=bounded, default=10, help="Newest entries to print (0-1000).")
        action = parser.add_mutually_exclusive_group()
        action.add_argument("--replay", action="store_true", help="Put every record back on the queue.")
        action.add_argument("--purge", action="store_true", help="Forget every record.")

    def handle(self, *args, show: int, replay: bool, purge: bool, **options) -> None:
        if replay:
            result = usage_dead_letters_replay()
            self.stdout.write(f"{result.replayed} record(s) back on the queue for the next flush")
            if result.kept_day_closed:
                self.stdout.write(
                    f"{result.kept_day_closed} record(s) of days retention has closed left dead-lettered: "
                    "those days' usage is final and would never count them (--purge forgets them)"
                )
            return
        if purge:
            self.stdout.write(f"{usage_dead_letters_purge()} record(s) forgotten")
            return
        try:
            total, reasons, newest = usage_dead_letters(newest=show)
        except ValueError as error:
            raise CommandError(f"unreadable dead-letter entry: {error}") from error
        self.stdout.write(f"{total} dead-lettered usage record(s)")
        for reason, count in reasons.most_common():
            self.stdout.write(f"  {reason}: {count}")
        for entry in newest:
            when = dt.datetime.fromtimestamp(entry["at"], tz=dt.UTC).isoformat(timespec="seconds")
            self.stdout.write(f"{when} {entry['reason']} {entry['record']}")
