"""The worker's own upkeep (docs/worker.md#stalled-jobs): jobs of vanished workers are retried,
and old finished jobs are removed; and the content-addressed store's collection."""

from __future__ import annotations

import logging
from datetime import timedelta
from uuid import UUID

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db.models.functions import Now
from procrastinate import JobContext
from procrastinate.contrib.django import app

from paperclip.models import JobError, WorkerProcess
from paperclip.snapshots.adopt import ADOPT_TASK, CwdUnadoptable, workspace_cwd_adopt
from paperclip.snapshots.collect import cas_collect
from paperclip.worker.process import database_back_for, requeue_job
from paperclip.worker.schedule import maintenance_task

logger = logging.getLogger(__name__)

COLLECT_BATCH_SIZE = 500


@maintenance_task(
    "recover_stalled_jobs", every="PAPERCLIP_STALLED_JOB_INTERVAL_SECONDS", pass_context=True
)
async def recover_stalled_jobs(context: JobContext, timestamp: int) -> str:
    """Retry the running jobs of workers whose heartbeat is older than
    PAPERCLIP_WORKER_STALLED_AFTER_SECONDS (killed, frozen, cut off). A retried finalization is
    safe: it meets the finalization lock (`busy`, when the frozen worker still holds it) or the
    dead owner's receipt (a board hold), never a second copy-back. A job whose queueing lock is
    already taken by a waiting job (the reconciler deferred the same work) is closed as failed
    instead: the waiting job does that work."""
    back_for = database_back_for()
    if back_for < settings.PAPERCLIP_WORKER_STALLED_AFTER_SECONDS:
        # Every worker was cut off alike: give them a stalled timeout to heartbeat again
        # before taking their silence for death (docs/worker.md#postgresql-failover).
        return f"waiting: the database came back {back_for:.0f} s ago"
    manager = context.app.job_manager
    stalled = list(
        await manager.get_stalled_jobs(
            seconds_since_heartbeat=settings.PAPERCLIP_WORKER_STALLED_AFTER_SECONDS
        )
    )
    retried = closed = 0
    for job in stalled:
        outcome = await requeue_job(manager, job)
        if outcome.startswith("closed"):
            closed += 1
        else:
            retried += 1
        logger.warning("stalled job %s (%s) of a lost worker: %s", job.id, job.task_name, outcome)
    return f"stalled {len(stalled)}: retried {retried}, closed {closed} (work already queued)"


@maintenance_task("remove_old_jobs", cron="17 3 * * *", pass_context=True)
async def remove_old_jobs(context: JobContext, timestamp: int) -> str:
    """Daily: finished jobs older than PAPERCLIP_JOB_RETENTION_HOURS go (failed ones too, with
    their recorded errors), and so do registrations of workers stopped that long ago."""
    hours = settings.PAPERCLIP_JOB_RETENTION_HOURS
    await context.app.job_manager.delete_old_jobs(nb_hours=hours, include_failed=True)
    cutoff = Now() - timedelta(hours=hours)
    errors, _ = await sync_to_async(JobError.objects.filter(occurred_at__lt=cutoff).delete)()
    workers, _ = await sync_to_async(WorkerProcess.objects.filter(stopped_at__lt=cutoff).delete)()
    return f"removed jobs older than {hours} h, {errors} job error(s), {workers} worker record(s)"


@maintenance_task("cas_collect", every="PAPERCLIP_CAS_COLLECT_INTERVAL_SECONDS")
def cas_collect_blobs(timestamp: int) -> str:
    """`manage.py cas_collect`, every PAPERCLIP_CAS_COLLECT_INTERVAL_SECONDS: unreferenced
    blobs older than the grace go (docs/snapshots.md#collection)."""
    summary = cas_collect(batch_size=COLLECT_BATCH_SIZE)
    return (
        f"deleted {summary.deleted} blob(s), {summary.bytes} bytes, in {summary.batches} "
        f"batch(es) over {summary.companies} company(ies); skipped {len(summary.skipped_companies)}"
    )


@app.task(name=ADOPT_TASK, queue="finalization")
def adopt_workspace_cwd(company_id: str, workspace_id: str) -> str:
    """A new workspace's cwd becomes its first head (docs/snapshots.md#adopting-an-existing-cwd)."""
    try:
        tree = workspace_cwd_adopt(company_id=UUID(company_id), workspace_id=UUID(workspace_id))
    except CwdUnadoptable as exc:
        return f"not adopted: {exc}"
    return f"adopted {tree}" if tree else "nothing to adopt"
