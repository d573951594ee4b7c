"""Finalization jobs (docs/worker.md#finalization-in-the-worker): who defers them, and the
`POST .../finalize` request that wakes one now.

A run has at most one waiting finalization job (queueing lock `finalize-run:<run_id>`); the
finalization advisory lock and owner receipt stay the safety mechanism, so two jobs of one run
on two workers still admit one owner. Jobs are deferred in the transaction of their cause: an
accepted result, an owner-stop confirmation, a finalize request, an owner release that left
work behind (a scheduled retry, a lost owner).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal
from uuid import UUID

from django.db import transaction

from paperclip.activity import activity_record
from paperclip.db.clock import db_now
from paperclip.db.locking import require_transaction
from paperclip.models import NativeRunFinalization
from paperclip.worker.jobs import job_cancel_in_tx, job_defer_in_tx, pending_jobs
from recovery.errors import FinalizationNotReady
from recovery.locks import coordinators_for_update, finalization_queueing_lock
from recovery.selectors.actions import HEAD_CONFLICT_CODE, WAITING_PHASES

FINALIZE_TASK = "finalize_run"
# A follow-up deferred by an owner as it lets go starts no sooner than this, so that it finds
# the advisory lock released (the release commits just before the lock transaction ends).
FOLLOW_UP_DELAY = timedelta(seconds=1)


def finalization_defer_in_tx(
    *,
    company_id: UUID,
    run_id: UUID,
    explicit: bool = False,
    schedule_at: datetime | None = None,
) -> int | None:
    """Defer the run's finalization job in the current transaction; None when one is already
    waiting. `explicit` attempts even a run whose retry time is ahead or whose retry budget is
    spent (a finalize request, a board confirmation); otherwise the job rechecks, under
    ownership, that the run is due. An explicit job is never left to ride on a waiting job
    that is not explicit or starts later (an owner's follow-up at its retry time, which finds
    a spent budget not due and does nothing): that job is cancelled and replaced; an explicit
    one already waiting to start now is the answer (its id)."""
    require_transaction()
    if explicit:
        now = db_now()
        for job in pending_jobs(finalization_queueing_lock(run_id)):
            if job.status != "todo":
                continue
            if job.args.get("explicit") is True and (
                job.scheduled_at is None or job.scheduled_at <= now
            ):
                return job.id
            job_cancel_in_tx(job.id)
    return job_defer_in_tx(
        FINALIZE_TASK,
        queueing_lock=finalization_queueing_lock(run_id),
        schedule_at=schedule_at,
        company_id=str(company_id),
        run_id=str(run_id),
        explicit=explicit,
    )


def finalization_follow_up_in_tx(*, company_id: UUID, run_id: UUID) -> int | None:
    """As an owner lets go: if the run still waits for finalization (a retry was scheduled,
    or the owner stopped before committing), defer the job that carries on, at the retry time
    (database clock). Nothing for a committed run, a spent retry budget or a run held over a
    workspace head conflict (the board's resolution defers its own job)."""
    require_transaction()
    coordinator = NativeRunFinalization.objects.filter(run_id=run_id, company_id=company_id).first()
    if (
        coordinator is None
        or coordinator.phase not in WAITING_PHASES
        or coordinator.failure_code == HEAD_CONFLICT_CODE
    ):
        return None
    earliest = db_now() + FOLLOW_UP_DELAY
    due = coordinator.next_attempt_at
    return finalization_defer_in_tx(
        company_id=company_id,
        run_id=run_id,
        schedule_at=due if due is not None and due > earliest else earliest,
    )


@dataclass(frozen=True, slots=True)
class FinalizationRequest:
    run_id: UUID
    status: Literal["queued", "committed"]
    job_id: int | None  # the waiting job that will attempt it (None when committed)
    created: bool  # False when an equivalent job was already waiting: nothing was written


def finalization_request(
    *, company_id: UUID, run_id: UUID, actor_type: str, actor_id: str
) -> FinalizationRequest:
    """Wake the run's finalization now (`POST /api/heartbeat-runs/{id}/finalize`).

    A committed run answers `committed` and writes nothing. A run with a job already waiting
    to start now answers `queued` and writes nothing. Otherwise a job is deferred to attempt it
    at once, replacing a waiting job scheduled later (a retry back-off) so that the request is
    not held behind it, with one audit row (`run.finalization_requested`).
    Locks: the coordinator row FOR NO KEY UPDATE (two requests at once defer one job).
    Raises FinalizationNotReady when the run has no accepted result.
    """
    with transaction.atomic():
        coordinator = coordinators_for_update().filter(run_id=run_id, company_id=company_id).first()
        if coordinator is not None and coordinator.phase == NativeRunFinalization.Phase.COMMITTED:
            return FinalizationRequest(run_id, "committed", None, created=False)
        if (
            coordinator is None
            or coordinator.result_id is None
            or coordinator.phase
            not in (
                *WAITING_PHASES,
                NativeRunFinalization.Phase.RETRYABLE_FAILURE,
            )
        ):
            raise FinalizationNotReady(run_id=str(run_id))
        now = db_now()
        replaced: int | None = None
        for job in pending_jobs(finalization_queueing_lock(run_id)):
            if job.status != "todo":
                continue
            starts_now = job.scheduled_at is None or job.scheduled_at <= now
            if starts_now and (job.args.get("explicit") is True or _due(coordinator, now)):
                return FinalizationRequest(run_id, "queued", job.id, created=False)
            if job_cancel_in_tx(job.id):
                replaced = job.id
        job_id = finalization_defer_in_tx(company_id=company_id, run_id=run_id, explicit=True)
        activity_record(
            company_id=company_id,
            actor_type=actor_type,
            actor_id=actor_id,
            action="run.finalization_requested",
            entity_type="heartbeat_run",
            entity_id=run_id,
            run_id=run_id,
            details={"jobId": job_id, "replacedJobId": replaced},
        )
        return FinalizationRequest(run_id, "queued", job_id, created=True)


def _due(coordinator: NativeRunFinalization, now: datetime) -> bool:
    return coordinator.phase in WAITING_PHASES and (
        coordinator.next_attempt_at is None or coordinator.next_attempt_at <= now
    )
