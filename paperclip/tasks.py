"""The worker's own upkeep (docs/worker.md#stalled-jobs): jobs of vanished workers are retried,
and old finished jobs are removed (both in paperclip.worker.upkeep); and the content-addressed
store's collection."""

from __future__ import annotations

from uuid import UUID

from procrastinate import JobContext
from procrastinate.contrib.django import app

from paperclip.snapshots.adopt import ADOPT_TASK, CwdUnadoptable, workspace_cwd_adopt
from paperclip.snapshots.collect import cas_collect
from paperclip.worker.schedule import maintenance_task
from paperclip.worker.upkeep import old_jobs_remove, stalled_jobs_recover

COLLECT_BATCH_SIZE = 500


@maintenance_task(
    "recover_stalled_jobs", every="PAPERCLIP_STALLED_JOB_INTERVAL_SECONDS", pass_context=True
)
async def recover_stalled_jobs(context: JobContext, timestamp: int) -> str:
    """`manage.py recover_stalled_jobs`, every PAPERCLIP_STALLED_JOB_INTERVAL_SECONDS: the
    running jobs of workers whose heartbeat is stale are retried (paperclip.worker.upkeep)."""
    recovery = await stalled_jobs_recover(manager=lambda: context.app.job_manager)
    return recovery.text


@maintenance_task("remove_old_jobs", cron="17 3 * * *", pass_context=True)
async def remove_old_jobs(context: JobContext, timestamp: int) -> str:
    """`manage.py remove_old_jobs`, daily: finished jobs, their errors and stopped workers'
    registrations older than PAPERCLIP_JOB_RETENTION_HOURS go."""
    return (await old_jobs_remove(manager=context.app.job_manager)).text


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
