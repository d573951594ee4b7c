"""`manage.py sweep_runtime_leases [--dry-run] [--batch-size N]`: delete stale runtime leases."""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError

from leases.services import RuntimeLeaseSweepBatch, runtime_lease_sweep
from paperclip.errors import DomainError
from paperclip.management.sweeps import SweepCommand


class Command(SweepCommand):
    unit = "leases"

    help = (
        "Delete runtime leases whose owner is stale (expired, owner issue missing/hidden/"
        "terminal, owner run missing/terminal), in batches. A lease renewed or reclaimed "
        "while the sweep runs survives: each one is re-checked under its row lock."
    )

    def handle(self, *args: Any, **options: Any) -> None:
        batch_size, dry_run, verb = self.sweep_options(options)

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
        if report.floors_raised:
            self.stdout.write(
                f"Raised the expiry floor of {report.floors_raised} live lease(s) to their expiry."
            )
