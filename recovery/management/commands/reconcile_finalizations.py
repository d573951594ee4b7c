"""`manage.py reconcile_finalizations [--batch-size N]`: defer a job for every waiting run."""

from __future__ import annotations

from typing import Any
from uuid import UUID

from django.core.management.base import BaseCommand, CommandParser

from paperclip.worker.health import worker_fresh
from recovery.services import finalizations_reconcile


class Command(BaseCommand):
    help = (
        "Defer a finalization job for every run whose coordinator waits for it (result_accepted "
        "/ workspace_finalizing, retry time reached); the worker runs them. Busy owners and "
        "runs held for the board are skipped, and nothing counts against the retry budget. The "
        "worker runs this every PAPERCLIP_RECONCILE_INTERVAL_SECONDS by itself."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--batch-size", type=int, default=50)

    def handle(self, *args: Any, **options: Any) -> None:
        batch_size = max(1, int(options["batch_size"]))

        def progress(run_id: UUID | None, text: str) -> None:
            self.stdout.write(f"  run {run_id}: {text}" if run_id else text)

        summary = finalizations_reconcile(batch_size=batch_size, progress=progress)
        self.stdout.write(
            f"examined {summary.examined}: deferred {summary.deferred}, already queued "
            f"{summary.already_queued}, skipped busy {summary.skipped_busy}, skipped held "
            f"{summary.skipped_held}"
        )
        if summary.deferred and not worker_fresh():
            self.stderr.write(
                "warning: no worker heartbeat is fresh, so nothing will run these jobs; start "
                "one with `manage.py run_worker` (or `make run`)."
            )
