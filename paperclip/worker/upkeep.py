"""The worker's own upkeep (docs/worker.md#stalled-jobs), one code path for the periodic tasks
(`paperclip.tasks`) and the commands of the same name (`manage.py recover_stalled_jobs`,
`manage.py remove_old_jobs`): jobs of vanished workers are retried, and old finished jobs are
removed."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db.models.functions import Now
from procrastinate.contrib.django import app
from procrastinate.jobs import Job
from procrastinate.manager import JobManager

from paperclip.models import JobError, WorkerProcess
from paperclip.worker.process import database_back_for, requeue_job

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StalledRecovery:
    waiting_since: float | None  # seconds since the database came back, when too recent
    stalled: int = 0
    retried: int = 0
    closed: int = 0  # the same work was already queued

    @property
    def text(self) -> str:
        if self.waiting_since is not None:
            return f"waiting: the database came back {self.waiting_since:.0f} s ago"
        return (
            f"stalled {self.stalled}: retried {self.retried}, closed {self.closed} "
            "(work already queued)"
        )


async def stalled_jobs_recover(
    *,
    manager: Callable[[], JobManager],
    on_job: Callable[[Job, str], None] | None = None,
) -> StalledRecovery:
    """Retry the running jobs of workers whose heartbeat is older than
    PAPERCLIP_WORKER_STALLED_AFTER_SECONDS (killed, frozen, cut off). A retried finalization is
    safe: it meets the finalization lock (`busy`, when the frozen worker still holds it) or the
    dead owner's receipt (a board hold), never a second copy-back. A job whose queueing lock is
    already taken by a waiting job (the reconciler deferred the same work) is closed as failed
    instead: the waiting job does that work. `manager` is asked for only once the database
    has been back long enough; `on_job` hears each job's outcome."""
    back_for = database_back_for()
    if back_for < settings.PAPERCLIP_WORKER_STALLED_AFTER_SECONDS:
        # Every worker was cut off alike: give them a stalled timeout to heartbeat again
        # before taking their silence for death (docs/worker.md#postgresql-failover).
        return StalledRecovery(waiting_since=back_for)
    jobs = manager()
    stalled = list(
        await jobs.get_stalled_jobs(
            seconds_since_heartbeat=settings.PAPERCLIP_WORKER_STALLED_AFTER_SECONDS
        )
    )
    retried = closed = 0
    for job in stalled:
        outcome = await requeue_job(jobs, job)
        if outcome.startswith("closed"):
            closed += 1
        else:
            retried += 1
        logger.warning("stalled job %s (%s) of a lost worker: %s", job.id, job.task_name, outcome)
        if on_job is not None:
            on_job(job, outcome)
    return StalledRecovery(None, len(stalled), retried, closed)


@dataclass(frozen=True, slots=True)
class OldJobsRemoval:
    hours: int
    job_errors: int
    workers: int

    @property
    def text(self) -> str:
        return (
            f"removed jobs older than {self.hours} h, {self.job_errors} job error(s), "
            f"{self.workers} worker record(s)"
        )


async def old_jobs_remove(*, manager: JobManager) -> OldJobsRemoval:
    """Finished jobs older than PAPERCLIP_JOB_RETENTION_HOURS go (failed ones too, with their
    recorded errors), and so do registrations of workers stopped that long ago."""
    hours = int(settings.PAPERCLIP_JOB_RETENTION_HOURS)
    await manager.delete_old_jobs(nb_hours=hours, include_failed=True)
    cutoff = Now() - timedelta(hours=hours)
    errors, _ = await sync_to_async(JobError.objects.filter(occurred_at__lt=cutoff).delete)()
    workers, _ = await sync_to_async(WorkerProcess.objects.filter(stopped_at__lt=cutoff).delete)()
    return OldJobsRemoval(hours, errors, workers)


def with_job_manager[T](work: Callable[[JobManager], Awaitable[T]]) -> T:
    """Run `work` once, outside any worker, with a job manager on the worker's own connector
    (what `run_worker` uses): the commands' way to run the upkeep a periodic task runs."""
    connector = app.connector.get_worker_connector()  # type: ignore[attr-defined]

    async def main() -> T:
        with app.replace_connector(connector) as worker_app:
            async with worker_app.open_async():
                return await work(worker_app.job_manager)

    return asyncio.run(main())
