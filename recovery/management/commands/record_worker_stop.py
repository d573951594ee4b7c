"""`manage.py record_worker_stop`: store a worker platform's signed stop receipt."""

from __future__ import annotations

from typing import Any
from uuid import UUID

from django.core.management.base import BaseCommand, CommandError, CommandParser

from paperclip.errors import DomainError
from recovery.services.worker_stops import worker_stop_record


class Command(BaseCommand):
    help = (
        "Record that a deployment worker (and every process it started) holding a "
        "finalization owner receipt has stopped. The signature is the hex HMAC-SHA256 of "
        'canonical JSON {"ownerToken","runId","stoppedAt","workerId"} under '
        "PAPERCLIP_PLATFORM_STOP_SECRET."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--run", type=UUID, required=True)
        parser.add_argument("--token", required=True, help="the owner receipt's token")
        parser.add_argument("--worker", required=True, help="the worker id in the receipt")
        parser.add_argument("--stopped-at", required=True, help="ISO-8601, as signed")
        parser.add_argument("--signature", required=True)

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            recorded = worker_stop_record(
                run_id=options["run"],
                owner_token=options["token"],
                worker_id=options["worker"],
                stopped_at=options["stopped_at"],
                signature=options["signature"],
            )
        except DomainError as exc:
            raise CommandError(f"{exc.code}: {exc.text}") from exc
        verb = "recorded" if recorded.created else "already recorded"
        self.stdout.write(f"stop receipt {recorded.receipt.pk} {verb}")
