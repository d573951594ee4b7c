"""Committing a finalized run: coordinator and run committed, the issue's slots released,
its holds resolved, in one transaction fenced by the owner receipt."""

from __future__ import annotations

from dataclasses import replace
from typing import Any
from uuid import UUID

from django.db import transaction
from django.db.models import Q
from django.db.models.functions import Now

from paperclip.activity import activity_record
from paperclip.models import (
    ExecutionWorkspace,
    HeartbeatRun,
    Issue,
    NativeRunFinalization,
    NativeRunResult,
    WorkspaceOperation,
)
from paperclip.services import issue_slots_release_in_tx, run_finish_in_tx
from paperclip.snapshots.head import PublishPlan, head_publish_in_tx
from recovery.adapters.copyback import CopybackError, CopybackReport
from recovery.errors import FinalizationNotReady
from recovery.locks import recovery_actions_for_update
from recovery.models import LIVE_STATUSES, IssueRecoveryAction
from recovery.selectors.actions import OWNER_UNVERIFIED_CAUSE
from recovery.selectors.exports import HELD_EXPORT
from recovery.services.actions import resolve_in_tx
from recovery.services.finalization.binding import (
    FINALIZER,
    locked_binding,
    require_receipt,
    run_phase_mirror,
    run_workspace_id,
)
from recovery.services.finalization.operations import finish_operation_in_tx, terminal_state
from recovery.services.finalization.outcomes import FinalizeOutcome, outcome_of
from recovery.services.ownership.lock_connection import FinalizationOwnership


class CopybackOvertaken(CopybackError):
    """A run's copy-back finished after another run published the workspace's first head:
    its cwd is made from the head, so what the copy wrote there (in no tree) would be removed
    by the next materialization. Not committed: held for the board as a copy-back refused
    with `workspace_has_head` (the run's directory, the copy's source, still holds its work)."""

    def __init__(self, head: str) -> None:
        super().__init__(
            "workspace_copyback_not_allowed",
            f"workspace_has_head: another run published the workspace's head ({head}) while"
            " this run's directory was copied back; send a snapshot tree instead",
        )
        self.head = head


def commit_finalized(
    *,
    ownership: FinalizationOwnership,
    company_id: UUID,
    run_id: UUID,
    operation_id: UUID | None,
    copied: CopybackReport | None,
    publish: PublishPlan | None = None,
    operation: WorkspaceOperation | None = None,
    operation_metadata: dict[str, Any] | None = None,
) -> FinalizeOutcome:
    """Coordinator and run → committed, the run reaches its terminal status, the issue's
    execution lock is cleared and the owner-unverified hold (if any) resolves; `operation`
    is marked succeeded in the same transaction. With `publish`, the workspace head moves in
    this same transaction too (HeadMoved when another run moved it since the plan); after a
    local copy-back (`copied`), the cwd no longer holds any tree of the store, unless the
    workspace got a head meanwhile: then nothing is committed and CopybackOvertaken is raised
    (the head is read under the workspace row's lock, which every head move takes, so a
    publish cannot slip in between)."""
    with transaction.atomic(durable=True):
        issue, coordinator, run = locked_binding(company_id=company_id, run_id=run_id)
        if coordinator is None:
            raise FinalizationNotReady(run_id=str(run_id))
        # Fence inside the transaction: the run row is locked, so our receipt can't change
        # between this check and the commit.
        require_receipt(run, ownership)
        if coordinator.phase == NativeRunFinalization.Phase.COMMITTED:
            return outcome_of(coordinator, run, "already_committed")
        workspace_id = run_workspace_id(run, issue) if copied is not None else None
        overtaken = (
            _head_published_meanwhile_in_tx(company_id, run_id, workspace_id)
            if publish is None and workspace_id is not None
            else None
        )
        if overtaken is None:
            if publish is not None:
                head_publish_in_tx(company_id=company_id, run_id=run_id, plan=publish)
                operation_metadata = {"published": publish.as_json()}
            elif workspace_id is not None:
                ExecutionWorkspace.objects.filter(pk=workspace_id).update(cwd_tree=None)
            if operation is not None:
                finish_operation_in_tx(
                    operation=operation, succeeded=True, metadata=operation_metadata or {}
                )
            return _commit_in_tx(
                company_id=company_id,
                run_id=run_id,
                operation_id=operation_id,
                copied=copied,
                publish=publish,
                issue=issue,
                coordinator=coordinator,
                run=run,
            )
    raise CopybackOvertaken(overtaken)


def _head_published_meanwhile_in_tx(
    company_id: UUID, run_id: UUID, workspace_id: UUID
) -> str | None:
    """The workspace's head, read under its row's lock, when it has one: the cwd a copy-back
    just replaced is then marked unknown (the next materialization writes the head back), with
    one `workspace.copyback_overtaken` audit row."""
    head: str | None = (
        ExecutionWorkspace.objects.select_for_update(no_key=True)
        .filter(pk=workspace_id, company_id=company_id)
        .values_list("head_tree", flat=True)
        .first()
    )
    if head is None:
        return None
    ExecutionWorkspace.objects.filter(pk=workspace_id).update(cwd_tree=None, updated_at=Now())
    activity_record(
        company_id=company_id,
        actor_type="system",
        actor_id=FINALIZER,
        action="workspace.copyback_overtaken",
        entity_type="execution_workspace",
        entity_id=workspace_id,
        run_id=run_id,
        details={"head": head, "runId": str(run_id)},
    )
    return head


def _commit_in_tx(
    *,
    company_id: UUID,
    run_id: UUID,
    operation_id: UUID | None,
    copied: CopybackReport | None,
    publish: PublishPlan | None,
    issue: Issue,
    coordinator: NativeRunFinalization,
    run: HeartbeatRun,
) -> FinalizeOutcome:
    """The commit itself, inside commit_finalized's transaction (the binding locked and
    fenced, the head moved or the cwd marked)."""
    result = (
        NativeRunResult.objects.filter(pk=coordinator.result_id).first()
        if coordinator.result_id is not None
        else None
    )
    previous_status = run.status
    coordinator.phase = NativeRunFinalization.Phase.COMMITTED
    coordinator.next_attempt_at = None
    coordinator.failure_code = None
    coordinator.failure_detail = None
    coordinator.updated_at = Now()
    coordinator.save()
    run_phase_mirror(run, NativeRunFinalization.Phase.COMMITTED)
    # The run's own lifecycle step (terminal status, freeing the issue's execution and
    # checkout slots, its status_changed audit row) is the core service's, shared with PATCH.
    if not run.is_terminal:
        issue_lock_cleared = run_id in (
            issue.execution_run_id,
            issue.checkout_run_id,
        )
        run_finish_in_tx(
            run=run,
            to_status=terminal_state(result),
            actor_type="system",
            actor_id=FINALIZER,
            details={"resultId": str(coordinator.result_id), "via": "finalization"},
        )
    else:
        issue_lock_cleared = issue_slots_release_in_tx(run_id=run_id)
    activity_record(
        company_id=company_id,
        actor_type="system",
        actor_id=FINALIZER,
        action="run.finalization_committed",
        entity_type="heartbeat_run",
        entity_id=run_id,
        run_id=run_id,
        details={
            "resultId": str(coordinator.result_id),
            "fromStatus": previous_status,
            "toStatus": run.status,
            "operationId": str(operation_id) if operation_id else None,
            "issueLockCleared": issue_lock_cleared,
        },
    )
    holds = recovery_actions_for_update().filter(
        Q(cause=OWNER_UNVERIFIED_CAUSE) | HELD_EXPORT,
        company_id=company_id,
        source_issue_id=issue.pk,
        status__in=LIVE_STATUSES,
        evidence__runId=str(run_id),
    )
    for hold in holds:
        resolve_in_tx(
            action=hold,
            status=IssueRecoveryAction.Status.RESOLVED,
            outcome=IssueRecoveryAction.Outcome.RESTORED,
            resolution_note="Workspace finalization committed the saved result.",
            actor_type="system",
            actor_id=FINALIZER,
        )
    run.refresh_from_db()
    coordinator.refresh_from_db()
    outcome = outcome_of(coordinator, run, "committed", operation_id=operation_id, copied=copied)
    return replace(outcome, published=publish)
