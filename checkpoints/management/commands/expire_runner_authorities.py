"""List, and expire, controller leases of running runs that lapsed while holding checkpoints."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from checkpoints.selectors import list_expired_authorities
from checkpoints.services import controller_leases_expire


class Command(BaseCommand):
    help = (
        "Find running native runs whose coordinator is observed with no result, whose "
        "controller lease is past expiry (or was never set), and that have checkpoint parts; "
        "clear their lease owner so the lapsed controller is fenced off for good, with one "
        "audit row each. Runs locked by another transaction are skipped and picked up by a "
        "later sweep."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--batch-size", type=int, default=200)
        parser.add_argument("--dry-run", action="store_true", help="List only; change nothing.")

    def handle(self, *args: Any, **options: Any) -> None:
        batch_size: int = options["batch_size"]
        if batch_size < 1:
            raise CommandError("--batch-size must be at least 1")
        dry_run: bool = options["dry_run"]
        after = None
        batch = found = expired = skipped = 0
        while True:
            run_ids = list_expired_authorities(after=after, limit=batch_size)
            if not run_ids:
                break
            batch += 1
            found += len(run_ids)
            after = run_ids[-1]
            if dry_run:
                for run_id in run_ids:
                    self.stdout.write(f"  would expire {run_id}")
                self.stdout.write(f"batch {batch}: {len(run_ids)} expired authorities (dry run)")
                continue
            result = controller_leases_expire(run_ids=run_ids)
            expired += len(result.expired)
            skipped += len(result.skipped)
            for run_id in result.expired:
                self.stdout.write(f"  expired {run_id}")
            self.stdout.write(
                f"batch {batch}: {len(run_ids)} found, {len(result.expired)} expired, "
                f"{len(result.skipped)} skipped (busy or already clear)"
            )
        if dry_run:
            self.stdout.write(f"done (dry run): {found} expired authorities, nothing changed")
        else:
            self.stdout.write(f"done: {found} found, {expired} expired, {skipped} skipped")
