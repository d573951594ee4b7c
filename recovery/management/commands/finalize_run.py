"""`manage.py finalize_run <run_id>`: finalize one native run's workspace under ownership."""

from __future__ import annotations

from typing import Any
from uuid import UUID

from django.core.management.base import BaseCommand, CommandError, CommandParser

from paperclip.errors import DomainError
from paperclip.models import HeartbeatRun
from recovery.errors import FinalizationOwnershipLost
from recovery.services import NotAcquired, run_finalize


class Command(BaseCommand):
    help = (
        "Finalize a native run's workspace (copy-back, then commit) under finalization ownership."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("run_id", type=UUID)

    def handle(self, *args: Any, **options: Any) -> None:
        run_id: UUID = options["run_id"]
        company_id = HeartbeatRun.objects.filter(pk=run_id).values_list("company_id", flat=True)
        company = company_id.first()
        if company is None:
            raise CommandError(f"run {run_id} not found")
        try:
            outcome = run_finalize(company_id=company, run_id=run_id)
        except DomainError as exc:
            raise CommandError(f"{exc.code}: {exc.text}") from exc
        except FinalizationOwnershipLost as exc:
            raise CommandError(
                f"ownership lost mid-way ({exc.reason}); nothing was committed"
            ) from exc
        if isinstance(outcome, NotAcquired):
            raise CommandError(f"finalization_not_acquired: {outcome.reason}")
        value = outcome.value
        copied = (
            f", copied {value.copied.files} file(s) / {value.copied.bytes} byte(s)"
            if value.copied
            else ""
        )
        self.stdout.write(
            f"run {run_id}: {value.status} (phase {value.phase}, run {value.run_status}{copied})"
        )
        if value.status in ("retry_scheduled", "retry_exhausted"):
            raise CommandError(f"copy-back failed: {value.failure_code}")
