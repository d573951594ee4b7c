"""Deferring jobs inside the transaction that causes them (docs/worker.md#jobs-and-their-causes).

Procrastinate's Django connector writes through Django's own connection, so a job deferred
inside `transaction.atomic()` commits or rolls back with the state change that needs it: a job
exists if and only if its cause committed. Tasks are deferred by name, so domain services never
import the task modules (which import them).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db import DEFAULT_DB_ALIAS, transaction
from procrastinate import exceptions as procrastinate_exceptions
from procrastinate import manager
from procrastinate.contrib.django import app
from procrastinate.contrib.django.django_connector import DjangoConnector
from procrastinate.contrib.django.models import ProcrastinateJob

from paperclip.db.locking import require_transaction

PENDING_STATUSES = ("todo", "doing")

# Deferring and cancelling always go through Django's own connection (so through the caller's
# transaction), also inside a worker process, whose app polls and listens on a connection pool
# of its own.
_in_transaction = manager.JobManager(DjangoConnector(alias=DEFAULT_DB_ALIAS))


@dataclass(frozen=True, slots=True)
class PendingJob:
    id: int
    status: str  # todo | doing
    scheduled_at: datetime | None
    args: dict[str, object]
    worker_id: int | None


def job_defer_in_tx(
    task_name: str,
    *,
    queueing_lock: str | None = None,
    schedule_at: datetime | None = None,
    **task_kwargs: object,
) -> int | None:
    """Defer `task_name` in the current transaction; return the job id, or None when a job with
    the same `queueing_lock` is already waiting (`todo`): at most one pending job per lock.

    The insert runs in a savepoint, so a queueing-lock conflict leaves the caller's transaction
    usable. Raises RuntimeError outside a transaction and procrastinate's TaskNotFound for a
    name no app registered.
    """
    require_transaction()
    deferrer = app.configure_task(
        task_name, allow_unknown=False, queueing_lock=queueing_lock, schedule_at=schedule_at
    )
    job = deferrer.make_new_job(**task_kwargs)  # type: ignore[arg-type]
    try:
        with transaction.atomic():
            return _in_transaction.defer_job(job).id
    except procrastinate_exceptions.AlreadyEnqueued:
        return None


def pending_jobs(queueing_lock: str) -> list[PendingJob]:
    """The jobs of `queueing_lock` still waiting or running (oldest first). A queueing lock is
    unique among waiting jobs only: one `todo` at most, besides any number `doing`."""
    rows = ProcrastinateJob.objects.filter(
        queueing_lock=queueing_lock, status__in=PENDING_STATUSES
    ).order_by("id")
    return [
        PendingJob(
            id=row.id,
            status=row.status,
            scheduled_at=row.scheduled_at,
            args=row.args if isinstance(row.args, dict) else {},
            worker_id=row.worker_id,
        )
        for row in rows
    ]


def job_cancel_in_tx(job_id: int) -> bool:
    """Cancel a waiting job in the current transaction; False when it is no longer `todo` (a
    worker took it meanwhile)."""
    require_transaction()
    return _in_transaction.cancel_job_by_id(job_id)


def job_status(job_id: int) -> str | None:
    """The job's status, or None when it no longer exists (finished jobs may be removed)."""
    return ProcrastinateJob.objects.filter(pk=job_id).values_list("status", flat=True).first()
