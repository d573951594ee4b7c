"""`manage.py interrupt_orphaned_runs [--batch-size N]`: the periodic orphan sweep, once now."""

from __future__ import annotations

from typing import Any
from uuid import UUID

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from leases.orphans import orphaned_runs_interrupt


class Command(BaseCommand):
    help = (
        "Interrupt the runs orphaned for longer than PAPERCLIP_ORPHANED_RUN_GRACE_SECONDS "
        "(running, their runtime lease gone or lapsed: docs/leases.md#orphaned-runs), each "
        "re-judged under its row lock, so a run renewed meanwhile is kept. The worker runs "
        "this every PAPERCLIP_LEASE_SWEEP_INTERVAL_SECONDS by itself."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--batch-size", type=int, default=200, help="Runs examined (default 200)."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        batch_size: int = options["batch_size"]
        if batch_size < 1:
            raise CommandError("--batch-size must be a positive integer")
        grace = float(settings.PAPERCLIP_ORPHANED_RUN_GRACE_SECONDS)
        self.stdout.write(f"looking for runs orphaned for more than {grace:g} s")

        def progress(run_id: UUID, outcome: str) -> None:
            self.stdout.write(f"  run {run_id}: {outcome}")

        sweep = orphaned_runs_interrupt(
            grace_seconds=grace, batch_size=batch_size, progress=progress
        )
        self.stdout.write(
            f"orphaned past the grace {sweep.examined}: interrupted {sweep.interrupted}, "
            f"revived {sweep.revived}, failed {len(sweep.failed)}"
        )
