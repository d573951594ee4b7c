"""`manage.py cas_collect [--dry-run] [--batch-size N]`: delete unreferenced old blobs."""

from __future__ import annotations

from typing import Any

from paperclip.management.sweeps import SweepCommand
from paperclip.snapshots.collect import CollectProgress, cas_collect


class Command(SweepCommand):
    unit = "blobs"

    help = (
        "Delete the content-addressed store's blobs that are older than "
        "PAPERCLIP_CAS_GRACE_SECONDS and reachable from no workspace head nor live run's "
        "snapshot, in batches (docs/snapshots.md#collection). A blob referenced while the "
        "collection runs survives: each batch re-checks the age on the row."
    )

    def handle(self, *args: Any, **options: Any) -> None:
        batch_size, dry_run, verb = self.sweep_options(options)

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
            reason = summary.skip_reasons.get(str(company_id), "a root cannot be walked")
            self.stdout.write(
                f"company {company_id}: skipped, nothing deleted (a root cannot be walked:"
                f" {reason}; repair it by uploading that blob again)"
            )
        prefix = "Dry run: " if dry_run else ""
        count = summary.candidates if dry_run else summary.deleted
        self.stdout.write(
            f"{prefix}{verb} {count} blob(s)"
            + ("" if dry_run else f", {summary.bytes} bytes, in {summary.batches} batch(es)")
            + f"; {summary.companies} company(ies) examined, "
            f"{len(summary.skipped_companies)} skipped."
        )
