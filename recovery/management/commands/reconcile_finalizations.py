"""`manage.py reconcile_finalizations [--batch-size N]`: finalize every waiting run."""

from __future__ import annotations

from typing import Any
from uuid import UUID

from django.core.management.base import BaseCommand, CommandParser

from recovery.services import finalizations_reconcile


class Command(BaseCommand):
    help = (
        "Finalize every run whose coordinator waits for it (result_accepted / "
        "workspace_finalizing, retry time reached). Busy or held owners are skipped "
        "without spending a retry."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--batch-size", type=int, default=50)

    def handle(self, *args: Any, **options: Any) -> None:
        batch_size = max(1, int(options["batch_size"]))

        def progress(run_id: UUID | None, text: str) -> None:
            self.stdout.write(f"  run {run_id}: {text}" if run_id else text)

        summary = finalizations_reconcile(batch_size=batch_size, progress=progress)
        skipped = ", ".join(f"{k}={v}" for k, v in sorted(summary.not_acquired.items()))
        self.stdout.write(
            f"examined {summary.examined}: committed {summary.committed}, "
            f"already committed {summary.already_committed}, copy-back failed {summary.failed}, "
            f"errors {summary.errors}, skipped {sum(summary.not_acquired.values())}"
            + (f" ({skipped})" if skipped else "")
        )
