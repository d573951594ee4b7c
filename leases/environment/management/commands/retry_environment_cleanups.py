"""`manage.py retry_environment_cleanups`: reopen failed cleanups whose back-off is over."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from leases.environment.services import environment_cleanups_retry_due


class Command(BaseCommand):
    help = (
        "Failed environment cleanups whose back-off (pendingCleanupRetryAfterMs, database "
        "clock) is over go back to cleanup `pending`, attempt count kept, one audit row each. "
        "The worker runs this every PAPERCLIP_CLEANUP_RETRY_INTERVAL_SECONDS by itself."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--batch-size", type=int, default=200)

    def handle(self, *args: Any, **options: Any) -> None:
        batch_size: int = options["batch_size"]
        if batch_size < 1:
            raise CommandError("--batch-size must be at least 1")
        total = 0
        while True:
            sweep = environment_cleanups_retry_due(batch_size=batch_size)
            total += len(sweep.reopened)
            for lease_id in sweep.reopened:
                self.stdout.write(f"  reopened {lease_id}")
            if sweep.examined < batch_size or not sweep.reopened:
                break
        self.stdout.write(f"done: {total} cleanup(s) reopened")
