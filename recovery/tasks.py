"""The recovery app's worker tasks (docs/worker.md#tasks): finalizing one run, materializing a
workspace's head into its cwd, and the periodic reconcilers that defer both."""

from __future__ import annotations

from uuid import UUID

from procrastinate.contrib.django import app

from paperclip.db.notify import FINALIZATION_CHANNEL, notify
from paperclip.snapshots.behind import MATERIALIZE_TASK
from paperclip.snapshots.head import materializations_reconcile, workspace_materialize
from paperclip.worker.schedule import maintenance_task
from recovery.errors import (
    FinalizationBindingMissing,
    FinalizationNotReady,
    FinalizationOwnershipLost,
)
from recovery.services import NotAcquired, finalizations_reconcile, run_finalize
from recovery.services.finalization_jobs import FINALIZE_TASK


@app.task(name=FINALIZE_TASK, queue="finalization")
def finalize_run(company_id: str, run_id: str, explicit: bool = False) -> str:
    """Finalize one run under finalization ownership; returns what happened.

    Outcomes that are part of the protocol end the job normally: `busy` (another owner is at
    work and defers its own follow-up as it lets go), a board hold, `not_due` (another attempt
    scheduled a retry meanwhile), a copy-back failure (the retry is deferred by the owner's
    release, at its back-off time). An unexpected exception fails the job (its error is kept
    for the admin) and the reconciler defers a new one within its interval.
    """
    try:
        outcome = run_finalize(
            company_id=UUID(company_id), run_id=UUID(run_id), due_only=not explicit
        )
    except (FinalizationBindingMissing, FinalizationNotReady) as exc:
        return f"not finalizable: {exc.code}"
    except FinalizationOwnershipLost as exc:
        return f"ownership lost mid-way ({exc.reason}); nothing was committed"
    finally:
        # However the attempt ended, a request waiting for it (`?wait=`) reads it now.
        notify(FINALIZATION_CHANNEL, run_id)
    if isinstance(outcome, NotAcquired):
        return f"not acquired: {outcome.reason}"
    value = outcome.value
    if value.failure_code:
        return f"{value.status}: {value.failure_code}"
    return value.status


@maintenance_task("reconcile_finalizations", every="PAPERCLIP_RECONCILE_INTERVAL_SECONDS")
def reconcile_finalizations(timestamp: int) -> str:
    """`manage.py reconcile_finalizations`, every PAPERCLIP_RECONCILE_INTERVAL_SECONDS."""
    summary = finalizations_reconcile()
    return (
        f"examined {summary.examined}, deferred {summary.deferred}, already queued "
        f"{summary.already_queued}, busy {summary.skipped_busy}, held {summary.skipped_held}"
    )


@app.task(name=MATERIALIZE_TASK, queue="finalization")
def materialize_workspace(workspace_id: str) -> str:
    """Make the workspace's cwd hold its head (docs/snapshots.md#materialization). A failure
    is recorded on the workspace and retried by the reconciler after its back-off: the job
    itself ends normally, saying so."""
    outcome = workspace_materialize(workspace_id=UUID(workspace_id))
    if outcome.status == "failed":
        attempt = outcome.failure
        when = (
            f"attempt {attempt.attempts}, next at {attempt.next_at.isoformat()}"
            if attempt is not None
            else "the workspace is gone"
        )
        return f"failed {outcome.tree}: {outcome.error} ({when})"
    if outcome.report is None:
        return f"{outcome.status} {outcome.tree or ''}".strip()
    report = outcome.report
    return (
        f"{outcome.status} {outcome.tree} ({report.written} written, {report.removed} removed,"
        f" {report.unchanged} unchanged)"
    )


@maintenance_task("reconcile_workspace_heads", every="PAPERCLIP_RECONCILE_INTERVAL_SECONDS")
def reconcile_workspace_heads(timestamp: int) -> str:
    """Defer a materialization for every workspace whose cwd is behind its head."""
    return f"deferred {materializations_reconcile()} materialization(s)"
