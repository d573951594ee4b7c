"""`manage.py cas_collect [--dry-run] [--batch-size N]`: delete unreferenced old blobs."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from paperclip.snapshots.collect import CollectProgress, cas_collect


class Command(BaseCommand):
    help = (
        "Delete the content-addressed store's blobs that are older than "
        "PAPERCLIP_CAS_GRACE_SECONDS and reachable from no workspace head nor live run's "
        "snapshot, in batches (docs/snapshots.md#collection). A blob referenced while the "
        "collection runs survives: each batch re-checks the age on the row."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--dry-run", action="store_true", help="Count what would be deleted; change nothing."
        )
        parser.add_argument(
            "--batch-size", type=int, default=500, help="Blobs per transaction (default 500)."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        batch_size: int = options["batch_size"]
        dry_run: bool = options["dry_run"]
        if batch_size < 1:
            raise CommandError("--batch-size must be a positive integer")
        verb = "would delete" if dry_run else "deleted"

        def progress(step: CollectProgress) -> None:
            if step.phase == "reached":
                self.stdout.write(
                    f"company {step.company_id}: {step.reachable} reachable, "
                    f"{step.candidates} old and unreachable"
                )
            else:
                self.stdout.write(f"batch {step.batch}: deleted {step.deleted}, {step.bytes} bytes")

        summary = cas_collect(batch_size=batch_size, progress=progress, dry_run=dry_run)
        for company_id in summary.skipped_companies:
            self.stdout.write(f"company {company_id}: skipped (a root is not a valid tree)")
        prefix = "Dry run: " if dry_run else ""
        count = summary.candidates if dry_run else summary.deleted
        self.stdout.write(
            f"{prefix}{verb} {count} blob(s)"
            + ("" if dry_run else f", {summary.bytes} bytes, in {summary.batches} batch(es)")
            + f"; {summary.companies} company(ies) examined, "
            f"{len(summary.skipped_companies)} skipped."
        )
