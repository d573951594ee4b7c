"""Publishing the run's snapshot tree into the workspace head under ownership, and holding
a conflict for the board (docs/snapshots.md#publishing)."""

from __future__ import annotations

from dataclasses import replace

from django.db import transaction
from django.db.models.functions import Now

from paperclip.errors import DomainError
from paperclip.models import HeartbeatRun, Issue, NativeRunFinalization, RunSnapshot
from paperclip.snapshots.adopt import CwdUnadoptable, workspace_cwd_adopt
from paperclip.snapshots.head import HeadMoved, PublishError, PublishPlan, publish_plan
from paperclip.snapshots.resolutions import resolution_plan
from recovery.errors import FinalizationNotReady, FinalizationOwnershipLost
from recovery.selectors.actions import HEAD_CONFLICT_CODE
from recovery.selectors.exports import workspace_destination
from recovery.services.conflicts import ConflictDecision, conflict_hold_in_tx, conflict_mode
from recovery.services.finalization.binding import locked_binding, require_receipt, run_workspace_id
from recovery.services.finalization.commit import commit_finalized
from recovery.services.finalization.operations import (
    attempt_failed,
    finish_operation,
    start_operation,
)
from recovery.services.finalization.outcomes import FinalizeOutcome, outcome_of
from recovery.services.ownership.lock_connection import FinalizationOwnership

# Plans made again when other runs keep moving the head between a plan and its commit.
MAX_HEAD_RACES = 5


def publish_owned(
    ownership: FinalizationOwnership,
    *,
    run: HeartbeatRun,
    issue: Issue,
    coordinator: NativeRunFinalization,
    tree: str,
) -> FinalizeOutcome:
    """Publish the run's snapshot as the workspace head in the commit
    (docs/snapshots.md#publishing): plan (fast-forward, merge, or the board's resolution merged
    against the head of now),
    then commit with the head moved by compare-and-set; a head moved meanwhile is planned
    again, a conflict is held for the board."""
    company_id, run_id = ownership.company_id, ownership.run_id
    mode = conflict_mode(company_id=company_id, run_id=run_id)
    if mode == "held":
        return outcome_of(coordinator, run, "held", failure_code=HEAD_CONFLICT_CODE)
    workspace_id = run_workspace_id(run, issue)
    snapshot = RunSnapshot.objects.filter(run_id=run_id, tree=tree).first()
    operation = start_operation(
        ownership=ownership,
        run=run,
        issue=issue,
        source=None,
        destination=workspace_destination(run, issue),
        command="publish",
        observation="snapshot",
    )
    try:
        if workspace_id is None or snapshot is None:
            raise PublishError(
                "snapshot_binding_missing", "The run's snapshot or workspace is gone."
            )
        decision = mode if isinstance(mode, ConflictDecision) else None
        for _ in range(MAX_HEAD_RACES):
            ownership.assert_held()
            if decision is None or decision.resolution != "discard":
                # Each round (a no-op once there is a head): a cwd filled since the last
                # round (a legacy copy-back committing) is adopted before the head moves.
                try:
                    workspace_cwd_adopt(company_id=company_id, workspace_id=workspace_id)
                except CwdUnadoptable as exc:
                    raise PublishError(exc.code, str(exc)) from exc
            if decision is not None and decision.resolution != "discard":
                # The board's merge, against the head it decided on and then the head of now.
                plan = resolution_plan(
                    company_id=company_id,
                    workspace_id=workspace_id,
                    tree=tree,
                    base=snapshot.base,
                    resolution=decision.resolution,
                    decided_head=decision.decided_head,
                )
                plan = replace(plan, action_id=decision.action_id, decided_by=decision.decided_by)
            else:
                plan = publish_plan(
                    company_id=company_id,
                    workspace_id=workspace_id,
                    tree=tree,
                    base=snapshot.base,
                    resolution="merge" if decision is None else "discard",
                )
            ownership.assert_held()
            if plan.kind == "conflict":
                finish_operation(
                    operation=operation,
                    succeeded=False,
                    metadata={"error": HEAD_CONFLICT_CODE, "publish": plan.as_json()},
                )
                return hold_conflict(ownership, issue=issue, plan=plan)
            try:
                return commit_finalized(
                    ownership=ownership,
                    company_id=company_id,
                    run_id=run_id,
                    operation_id=operation.pk,
                    copied=None,
                    publish=plan,
                    operation=operation,
                )
            except HeadMoved:
                continue  # another run published meanwhile: plan against its head
        raise PublishError("workspace_head_busy", "The head kept moving; retrying later.")
    except FinalizationOwnershipLost:
        finish_operation(operation=operation, succeeded=False, metadata={"error": "ownership_lost"})
        raise
    except (PublishError, DomainError, OSError) as exc:
        code = getattr(exc, "code", "publish_io_error")
        return attempt_failed(ownership, operation=operation, code=code, exc=exc)


def hold_conflict(
    ownership: FinalizationOwnership, *, issue: Issue, plan: PublishPlan
) -> FinalizeOutcome:
    """Hold the run for the board: nothing is published, no retry is spent."""
    with transaction.atomic(durable=True):
        _issue, coordinator, run = locked_binding(
            company_id=ownership.company_id, run_id=ownership.run_id
        )
        require_receipt(run, ownership)
        if coordinator is None:
            raise FinalizationNotReady(run_id=str(ownership.run_id))
        conflict_hold_in_tx(
            company_id=ownership.company_id,
            issue_id=issue.pk,
            run_id=run.pk,
            agent_id=run.agent_id,
            plan=plan,
        )
        coordinator.failure_code = HEAD_CONFLICT_CODE
        coordinator.failure_detail = {
            "code": HEAD_CONFLICT_CODE,
            "detail": f"{plan.conflict_count} conflicting path(s)",
            "conflictingPaths": list(plan.conflicts[:20]),
        }
        coordinator.next_attempt_at = None
        coordinator.updated_at = Now()
        coordinator.save(
            update_fields=["failure_code", "failure_detail", "next_attempt_at", "updated_at"]
        )
        return replace(
            outcome_of(coordinator, run, "held", failure_code=HEAD_CONFLICT_CODE), published=plan
        )
