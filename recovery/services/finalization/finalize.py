"""`run_finalize`: one finalization attempt of a run under finalization ownership (copy back
or publish, then commit)."""

from __future__ import annotations

import logging
from uuid import UUID

from django.db import InterfaceError, OperationalError
from django.db.models import Q
from django.db.models.functions import Now

from paperclip.errors import DomainError
from paperclip.models import HeartbeatRun, Issue, NativeRunFinalization, WorkspaceOperation
from paperclip.observability import metrics
from recovery.adapters.copyback import CopybackError, CopybackReport, copyback_backend
from recovery.errors import (
    FinalizationBindingMissing,
    FinalizationNotReady,
    FinalizationOwnershipLost,
    WorkspaceCopybackNotAllowed,
)
from recovery.selectors.actions import WAITING_PHASES
from recovery.selectors.exports import result_workspace_tree, workspace_destination, workspace_dir
from recovery.services.copyback_guard import (
    REFUSAL_TEXT,
    copyback_checked_source,
    copyback_workspace_refusal,
)
from recovery.services.finalization.binding import run_workspace_id
from recovery.services.finalization.commit import CopybackOvertaken, commit_finalized
from recovery.services.finalization.operations import (
    attempt_failed,
    finish_operation,
    schedule_retry,
    start_operation,
)
from recovery.services.finalization.outcomes import FinalizeOutcome, outcome_of
from recovery.services.finalization.publish import publish_owned
from recovery.services.ownership.acquire import with_finalization_ownership
from recovery.services.ownership.lock_connection import FinalizationOwnership
from recovery.services.ownership.outcomes import Acquired, NotAcquired

logger = logging.getLogger(__name__)


def attempt_not_due(run_id: UUID) -> bool:
    """The coordinator no longer waits for an automatic attempt: it moved past the waiting
    phases or its retry time (database clock) is still ahead."""
    waiting = NativeRunFinalization.objects.filter(run_id=run_id, phase__in=WAITING_PHASES)
    due = waiting.filter(Q(next_attempt_at__isnull=True) | Q(next_attempt_at__lte=Now()))
    return waiting.exists() and not due.exists()


def finalize_owned(ownership: FinalizationOwnership, *, due_only: bool) -> FinalizeOutcome:
    company_id, run_id = ownership.company_id, ownership.run_id
    run = (
        HeartbeatRun.objects.select_related("execution_workspace")
        .filter(pk=run_id, company_id=company_id)
        .first()
    )
    coordinator = NativeRunFinalization.objects.filter(run_id=run_id).first()
    if run is None:
        raise FinalizationBindingMissing(run_id=str(run_id))
    if coordinator is not None and coordinator.phase == NativeRunFinalization.Phase.COMMITTED:
        return outcome_of(coordinator, run, "already_committed")
    if (
        coordinator is None
        or coordinator.result_id is None
        or coordinator.phase not in (*WAITING_PHASES, "retryable_failure")
    ):
        raise FinalizationNotReady(run_id=str(run_id))
    if due_only and (coordinator.phase not in WAITING_PHASES or attempt_not_due(run_id)):
        # Rechecked under ownership (docs/recovery.md#reconciliation-of-finalizations): another
        # reconciler may have attempted it and scheduled a retry since our sweep selected it. Spend
        # nothing.
        return outcome_of(coordinator, run, "not_due")
    issue = Issue.objects.select_related("execution_workspace").get(pk=coordinator.issue_id)
    tree = result_workspace_tree(coordinator.result_id)
    if tree is not None:
        return publish_owned(ownership, run=run, issue=issue, coordinator=coordinator, tree=tree)
    barrier = WorkspaceOperation.objects.filter(
        company_id=company_id,
        heartbeat_run_id=run_id,
        issue_id=issue.pk,
        phase=WorkspaceOperation.PHASE_WORKSPACE_FINALIZE,
        status=WorkspaceOperation.Status.SUCCEEDED,
    ).first()
    if barrier is not None:
        # Copy-back already completed under an earlier owner; only the commit is left.
        ownership.assert_held()
        return commit_finalized(
            ownership=ownership,
            company_id=company_id,
            run_id=run_id,
            operation_id=barrier.pk,
            copied=None,
        )
    source, destination = workspace_dir(run), workspace_destination(run, issue)
    operation = start_operation(
        ownership=ownership, run=run, issue=issue, source=source, destination=destination
    )
    report: CopybackReport | None = None
    try:
        ownership.assert_held()
        if source is not None:
            report = _copy_back(ownership, run, issue, source, destination)
        ownership.assert_held()
    except FinalizationOwnershipLost:
        finish_operation(operation=operation, succeeded=False, metadata={"error": "ownership_lost"})
        raise
    except (CopybackError, OSError) as exc:
        code = exc.code if isinstance(exc, CopybackError) else "copyback_io_error"
        return attempt_failed(
            ownership,
            operation=operation,
            code=code,
            exc=exc,
            final=code == WorkspaceCopybackNotAllowed.code,
        )
    metadata = {
        "copied": None
        if report is None
        else {
            "files": report.files,
            "directories": report.directories,
            "bytes": report.bytes,
            "symlinks": report.symlinks,
            "skipped": list(report.skipped)[:100],
        },
    }
    ownership.assert_held()
    try:
        return commit_finalized(
            ownership=ownership,
            company_id=company_id,
            run_id=run_id,
            operation_id=operation.pk,
            copied=report,
            operation=operation,
            operation_metadata=metadata,
        )
    except CopybackOvertaken as exc:  # a head was published while the copy ran
        return attempt_failed(ownership, operation=operation, code=exc.code, exc=exc, final=True)


def _copy_back(
    ownership: FinalizationOwnership,
    run: HeartbeatRun,
    issue: Issue,
    source: str,
    destination: str | None,
) -> CopybackReport:
    if destination is None:
        raise CopybackError(
            "copyback_destination_missing",
            "The run has a workspace directory but its execution workspace has no cwd.",
        )
    # Again here, right before the copy: the directory may have been replaced since the
    # result was accepted (by a link into another workspace, say), the settings or the
    # workspaces changed, or another company's run named the directory since. The copy reads
    # the path judged here, resolved once, and nothing outside it (a link swapped in along
    # the agent's path afterwards is not followed).
    resolved, refusal = copyback_checked_source(source, company_id=run.company_id)
    refusal = refusal or copyback_workspace_refusal(run_workspace_id(run, issue))
    if refusal is not None:
        raise CopybackError(WorkspaceCopybackNotAllowed.code, f"{refusal}: {REFUSAL_TEXT[refusal]}")
    with metrics.COPYBACK_DURATION.time():
        report = copyback_backend().copy_back(
            run_id=ownership.run_id,
            source=resolved,
            destination=destination,
            check=ownership.assert_held,
        )
    metrics.COPYBACK_BYTES.inc(report.bytes)
    return report


def run_finalize(
    *, company_id: UUID, run_id: UUID, due_only: bool = False
) -> Acquired[FinalizeOutcome] | NotAcquired:
    """Finalize a run's workspace under finalization ownership: record `workspace_finalize`,
    copy the run's workspace directory back to the execution workspace's cwd, then commit.

    Returns NotAcquired(reason) when ownership isn't ours (see with_finalization_ownership).
    A copy-back failure keeps the saved result and schedules a retry (outcome
    retry_scheduled / retry_exhausted); a directory the copy-back guard refuses right before
    the copy (recovery.services.copyback_guard) is retry_exhausted at once, held for the board
    with failure code workspace_copyback_not_allowed. With `due_only` (the reconciler) a
    coordinator whose retry time is still ahead, rechecked under ownership, is left alone
    (outcome not_due).
    Locks: the finalization advisory lock (dedicated connection) for the whole run, then
    issue → coordinator → run per progress write. Raises FinalizationBindingMissing,
    FinalizationNotReady, FinalizationOwnershipLost (ownership lost mid-way: nothing is
    published after that).
    """

    def action(ownership: FinalizationOwnership) -> FinalizeOutcome:
        try:
            return finalize_owned(ownership, due_only=due_only)
        except (DomainError, FinalizationOwnershipLost, OperationalError, InterfaceError):
            raise  # the protocol's own outcomes; a lost database is retried as such
        except Exception as exc:
            # A failure the attempt did not foresee (a bug, data the database refuses): an
            # attempt failed like any other, backed off, counted against the budget and shown
            # on the run (`last_error`), never a job retried every second for ever.
            logger.exception("finalization of run %s failed unexpectedly", run_id)
            return schedule_retry(
                ownership=ownership,
                company_id=company_id,
                run_id=run_id,
                code="finalization_failed",
                detail=f"{type(exc).__name__}: {exc}"[:1000],
            )

    outcome = with_finalization_ownership(company_id=company_id, run_id=run_id, action=action)
    if isinstance(outcome, NotAcquired):
        metrics.FINALIZATIONS_NOT_ACQUIRED.labels(outcome.reason).inc()
    return outcome
