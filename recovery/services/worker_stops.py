"""Recording a worker platform's signed stop receipt (`POST /api/platform/worker-stops`,
`manage.py record_worker_stop`). Verifying a receipt when it is used is the platform
adapter's job (`recovery.adapters.platform`)."""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from uuid import UUID

from django.db import IntegrityError, transaction

from paperclip.activity import activity_record
from paperclip.errors import NotFoundError
from paperclip.models import HeartbeatRun
from recovery.adapters.platform import stop_secret, worker_stop_signature
from recovery.errors import WorkerStopPlatformDisabled, WorkerStopSignatureInvalid
from recovery.models import WorkerStopReceipt


@dataclass(frozen=True, slots=True)
class RecordedStop:
    receipt: WorkerStopReceipt
    created: bool


def worker_stop_record(
    *, run_id: UUID, owner_token: str, worker_id: str, stopped_at: str, signature: str
) -> RecordedStop:
    """Store a platform's signed stop receipt for (run, owner token).

    The signature is checked before the run is looked up, so an unsigned caller learns
    nothing about which runs exist. Idempotent on (run, owner token): a repeat returns the
    stored receipt. Raises WorkerStopPlatformDisabled, WorkerStopSignatureInvalid, NotFoundError.
    """
    secret = stop_secret()
    if not secret:
        raise WorkerStopPlatformDisabled()
    expected = worker_stop_signature(
        secret=secret,
        run_id=run_id,
        owner_token=owner_token,
        worker_id=worker_id,
        stopped_at=stopped_at,
    )
    if not hmac.compare_digest(expected, signature.lower()):
        raise WorkerStopSignatureInvalid()
    with transaction.atomic(durable=True):
        run = HeartbeatRun.objects.filter(pk=run_id).only("id", "company_id").first()
        if run is None:
            raise NotFoundError()
        existing = WorkerStopReceipt.objects.filter(run_id=run_id, owner_token=owner_token).first()
        if existing is not None:
            return RecordedStop(existing, created=False)
        try:
            with transaction.atomic():
                receipt = WorkerStopReceipt.objects.create(
                    company_id=run.company_id,
                    run_id=run_id,
                    owner_token=owner_token,
                    worker_id=worker_id,
                    stopped_at=stopped_at,
                    signature=signature.lower(),
                )
        except IntegrityError:
            # A concurrent identical report won the unique index; answer with its row.
            return RecordedStop(
                WorkerStopReceipt.objects.get(run_id=run_id, owner_token=owner_token),
                created=False,
            )
        activity_record(
            company_id=run.company_id,
            actor_type="system",
            actor_id="worker-platform",
            action="run.worker_stop_recorded",
            entity_type="heartbeat_run",
            entity_id=run_id,
            run_id=run_id,
            details={"workerId": worker_id, "ownerToken": owner_token, "stoppedAt": stopped_at},
        )
    return RecordedStop(receipt, created=True)
