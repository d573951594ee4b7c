"""What every batch sweep command shares: `--dry-run` and `--batch-size N`
(docs/runbook.md#commands)."""

from __future__ import annotations

from typing import Any, ClassVar

from django.core.management.base import BaseCommand, CommandError, CommandParser


class SweepCommand(BaseCommand):
    """A command that deletes in batches: `--dry-run` counts instead, `--batch-size` (a
    positive integer) bounds each transaction. Subclasses name what a batch holds (`unit`)."""

    unit: ClassVar[str] = "rows"
    default_batch_size: ClassVar[int] = 500

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--dry-run", action="store_true", help="List what would be deleted; change nothing."
        )
        parser.add_argument(
            "--batch-size",
            type=int,
            default=self.default_batch_size,
            help=f"{self.unit.capitalize()} per transaction (default {self.default_batch_size}).",
        )

    def sweep_options(self, options: dict[str, Any]) -> tuple[int, bool, str]:
        """(batch size, dry run, the verb its progress lines use); CommandError for a bad size."""
        batch_size: int = options["batch_size"]
        if batch_size < 1:
            raise CommandError("--batch-size must be a positive integer")
        dry_run: bool = options["dry_run"]
        return batch_size, dry_run, "would delete" if dry_run else "deleted"
