"""`manage.py sweep_runtime_leases [--dry-run] [--batch-size N]`: delete stale runtime leases."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from leases.services import RuntimeLeaseSweepBatch, runtime_lease_sweep
from paperclip.errors import DomainError


class Command(BaseCommand):
    help = (
        "Delete runtime leases whose owner is stale (expired, owner issue missing/hidden/"
        "terminal, owner run missing/terminal), in batches. A lease renewed or reclaimed "
        "while the sweep runs survives: each one is re-checked under its row lock."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--dry-run", action="store_true", help="List what would be deleted; change nothing."
        )
        parser.add_argument(
            "--batch-size", type=int, default=500, help="Leases per transaction (default 500)."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        batch_size: int = options["batch_size"]
        dry_run: bool = options["dry_run"]
        if batch_size < 1:
            raise CommandError("--batch-size must be a positive integer")
        verb = "would delete" if dry_run else "deleted"

        def progress(number: int, batch: RuntimeLeaseSweepBatch) -> None:
            line = f"batch {number}: examined {batch.examined}, {verb} {len(batch.deleted)}"
            if not dry_run:
                line += f", survived {batch.survived}, skipped (locked) {batch.skipped_locked}"
            self.stdout.write(line)

        try:
            report = runtime_lease_sweep(batch_size=batch_size, dry_run=dry_run, on_batch=progress)
        except DomainError as exc:
            raise CommandError(f"{exc.code}: {exc.text}") from exc
        prefix = "Dry run: " if dry_run else ""
        self.stdout.write(
            f"{prefix}{verb} {report.deleted} stale runtime lease(s) in {report.batches} "
            f"batch(es); survived {report.survived}, skipped (locked) {report.skipped_locked}."
        )
        for reason, count in sorted(report.by_reason.items()):
            self.stdout.write(f"  {reason}: {count}")
