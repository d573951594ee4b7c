"""List, and expire, controller leases of running runs that lapsed while holding checkpoints."""

from __future__ import annotations

from typing import Any
from uuid import UUID

from django.core.management.base import BaseCommand, CommandError, CommandParser

from checkpoints.selectors import list_expired_authorities
from checkpoints.services import AuthorityExpiry, expired_authorities_sweep


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
        if dry_run:
            after = None
            found = batch = 0
            while run_ids := list_expired_authorities(after=after, limit=batch_size):
                batch += 1
                found += len(run_ids)
                after = run_ids[-1]
                for run_id in run_ids:
                    self.stdout.write(f"  would expire {run_id}")
                self.stdout.write(f"batch {batch}: {len(run_ids)} expired authorities (dry run)")
            self.stdout.write(f"done (dry run): {found} expired authorities, nothing changed")
            return

        def progress(number: int, run_ids: list[UUID], result: AuthorityExpiry) -> None:
            for run_id in result.expired:
                self.stdout.write(f"  expired {run_id}")
            self.stdout.write(
                f"batch {number}: {len(run_ids)} found, {len(result.expired)} expired, "
                f"{len(result.skipped)} skipped (busy or already clear)"
            )

        sweep = expired_authorities_sweep(batch_size=batch_size, on_batch=progress)
        self.stdout.write(
            f"done: {sweep.found} found, {sweep.expired} expired, {sweep.skipped} skipped"
        )
