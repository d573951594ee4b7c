"""Workspace head conflicts: the board's hold when a run's changes overlap another run's
(docs/snapshots.md#conflicts), and the board's resolution.

The hold is a board-owned recovery action (`cause=workspace_head_conflict`) whose evidence
names the run, its tree and base, the head it met and up to 100 conflicting paths. While it is
live the run's finalization reads `held` and no attempt publishes anything. The board answers
`publish` or `keep_head` (merges against the head it decided on, taking the run's or the
head's side of each conflicting path: `paperclip.snapshots.resolutions`) or `discard`
(the run commits without publishing); the answer and the head it was made against are kept in
the resolved action's evidence, where the next finalization attempt (deferred in the same
transaction) reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal
from uuid import UUID

from django.db import transaction
from django.db.models.functions import Now

from paperclip.access import Actor
from paperclip.activity import activity_record
from paperclip.db.advisory import advisory_xact_lock
from paperclip.db.locking import require_transaction
from paperclip.errors import NotFoundError
from paperclip.models import ExecutionWorkspace, HeartbeatRun, Issue, NativeRunFinalization
from paperclip.snapshots.head import PublishPlan, conflict_fingerprint
from recovery.errors import WorkspaceConflictStale, WorkspaceHeadMoved
from recovery.locks import (
    recovery_actions_for_update,
    recovery_source_key,
)
from recovery.models import LIVE_STATUSES, IssueRecoveryAction
from recovery.selectors.actions import HEAD_CONFLICT_CODE
from recovery.services.actions import RecoveryActionInput, upsert_source_scoped_in_tx
from recovery.services.finalization_jobs import finalization_defer_in_tx

CONFLICT_CAUSE: Final = HEAD_CONFLICT_CODE
CONFLICT_NEXT_ACTION: Final = (
    "Two runs changed the same paths of the workspace. Read the preview of each resolution "
    "against the current head, then resolve: publish (the run's side of each conflicting "
    "path), keep_head (the head's side), or discard the run's changes; every other change of "
    "both sides is kept."
)

type Resolution = Literal["publish", "keep_head", "discard"]


@dataclass(frozen=True, slots=True)
class HeadExpected:
    """The board's compare-and-set: the head it saw (None: the empty workspace)."""

    tree: str | None


@dataclass(frozen=True, slots=True)
class ConflictDecision:
    resolution: Resolution
    decided_head: str | None  # the head the board decided against
    action_id: UUID | None = None  # the hold the board resolved
    decided_by: str | None = None  # who resolved it


def conflict_mode(*, company_id: UUID, run_id: UUID) -> Literal["merge", "held"] | ConflictDecision:
    """How the run's next publish goes: `held` while a conflict hold is live, the board's
    decision once it answered, else `merge`."""
    latest = (
        IssueRecoveryAction.objects.filter(
            company_id=company_id, cause=CONFLICT_CAUSE, evidence__runId=str(run_id)
        )
        .order_by("-created_at", "-id")
        .values_list("status", "evidence", "id")
        .first()
    )
    if latest is None:
        return "merge"
    status, evidence, action_id = latest
    if status in LIVE_STATUSES:
        return "held"
    if not isinstance(evidence, dict):
        return "merge"
    resolution = evidence.get("resolution")
    # A decision recorded before `decidedHead` existed was made against the head held.
    decided = evidence.get("decidedHead", evidence.get("head"))
    if resolution in ("publish", "keep_head", "discard"):
        by = evidence.get("resolvedBy")
        return ConflictDecision(
            resolution,
            decided if isinstance(decided, str) else None,
            action_id=action_id,
            decided_by=by if isinstance(by, str) else None,
        )
    return "merge"


def conflict_hold_in_tx(
    *, company_id: UUID, issue_id: UUID, run_id: UUID, agent_id: UUID, plan: PublishPlan
) -> IssueRecoveryAction:
    """Record (or keep) the board's hold for the run's conflicting publish: the run's own hold
    (docs/recovery.md#one-hold-per-held-run), updated when the same run meets another
    conflict, never cancelling another run's hold of the issue."""
    require_transaction()
    fingerprint = conflict_fingerprint(run_id, plan.tree, plan.expected_head)
    advisory_xact_lock(recovery_source_key(company_id, issue_id))
    live = (
        recovery_actions_for_update()
        .filter(
            company_id=company_id,
            source_issue_id=issue_id,
            cause=CONFLICT_CAUSE,
            fingerprint=fingerprint,
            status__in=LIVE_STATUSES,
        )
        .first()
    )
    if live is not None:
        return live  # the same conflict met again: nothing new to record
    upsert = upsert_source_scoped_in_tx(
        company_id=company_id,
        source_issue_id=issue_id,
        data=RecoveryActionInput(
            kind=IssueRecoveryAction.Kind.WORKSPACE_VALIDATION,
            owner_type=IssueRecoveryAction.OwnerType.BOARD,
            return_owner_agent_id=agent_id,
            cause=CONFLICT_CAUSE,
            fingerprint=fingerprint,
            evidence={
                "runId": str(run_id),
                "tree": plan.tree,
                "base": plan.base,
                "head": plan.expected_head,
                "conflictingPaths": list(plan.conflicts),
                "conflictCount": plan.conflict_count,
            },
            next_action=CONFLICT_NEXT_ACTION,
            wake_policy=None,
            max_attempts=1,
            # The run's own hold: a new conflict of this run (another head) updates it, and no
            # other run's hold on the issue is touched.
            held_run_id=run_id,
        ),
        actor_id="workspace_publisher",
    )
    return upsert.action


@dataclass(frozen=True, slots=True)
class ConflictResolution:
    run_id: UUID
    action_id: UUID
    resolution: Resolution
    status: Literal["queued"] = "queued"
    replayed: bool = False
    job_id: int | None = None  # the finalization job deferred (None on a repeat)


def workspace_conflict_resolve(
    *,
    actor: Actor,
    issue_id: UUID,
    action_id: UUID,
    run_id: UUID,
    resolution: Resolution,
    note: str,
    expected_head: HeadExpected | None = None,
) -> ConflictResolution:
    """The board resolves a workspace head conflict: `publish`, `keep_head` or `discard`.

    The hold must be live, of this issue and cause, and name this run (else
    WorkspaceConflictStale); a repeat of the same resolution answers the same and writes
    nothing, another resolution of a resolved hold is stale. With `expected_head`, a head that
    is no longer that tree is WorkspaceHeadMoved (details `head`) and nothing is written. The
    resolution and the head it was made against (`decidedHead`) are recorded in the action's
    evidence, the action resolves, and the run's finalization job is deferred, all in one
    transaction; the worker publishes (docs/snapshots.md#conflicts). Locks: the issue's
    recovery advisory key, then the action row. Audited.
    """
    with transaction.atomic(durable=True):
        advisory_xact_lock(recovery_source_key(_issue_company(actor, issue_id), issue_id))
        # Under the issue's recovery key no other writer changes the hold, so it is read
        # unlocked and locked after the coordinator (paperclip rows before recovery rows).
        action = IssueRecoveryAction.objects.filter(
            pk=action_id, source_issue_id=issue_id, cause=CONFLICT_CAUSE
        ).first()
        if action is None or not actor.can_access(action.company_id):
            raise WorkspaceConflictStale(action_id=str(action_id), reason="no_such_hold")
        evidence = action.evidence if isinstance(action.evidence, dict) else {}
        if evidence.get("runId") != str(run_id):
            raise WorkspaceConflictStale(action_id=str(action_id), reason="another_run")
        if action.status not in LIVE_STATUSES:
            if evidence.get("resolution") == resolution:
                return ConflictResolution(run_id, action_id, resolution, replayed=True)
            raise WorkspaceConflictStale(action_id=str(action_id), reason="already_resolved")
        run = HeartbeatRun.objects.filter(pk=run_id, company_id=action.company_id).first()
        if run is None:
            raise WorkspaceConflictStale(action_id=str(action_id), reason="no_such_run")
        decided_head = _head_for_decision(run, issue_id, expected_head)
        # The run waits for a job again (the reconciler skips held runs).
        NativeRunFinalization.objects.filter(run_id=run_id, failure_code=HEAD_CONFLICT_CODE).update(
            failure_code=None, failure_detail=None, updated_at=Now()
        )
        action = recovery_actions_for_update().get(pk=action.pk)
        action.evidence = {
            **evidence,
            "resolution": resolution,
            "resolutionNote": note,
            "resolvedBy": actor.actor_id,
            "decidedHead": decided_head,
        }
        action.status = IssueRecoveryAction.Status.RESOLVED
        action.outcome = (
            IssueRecoveryAction.Outcome.CANCELLED
            if resolution == "discard"
            else IssueRecoveryAction.Outcome.RESTORED
        )
        action.resolution_note = note
        action.resolved_at = Now()
        action.updated_at = Now()
        action.save(
            update_fields=[
                "evidence",
                "status",
                "outcome",
                "resolution_note",
                "resolved_at",
                "updated_at",
            ]
        )
        job_id = finalization_defer_in_tx(
            company_id=action.company_id, run_id=run_id, explicit=True
        )
        activity_record(
            company_id=action.company_id,
            actor_type=actor.actor_type,
            actor_id=actor.actor_id,
            action="recovery_action.workspace_conflict_resolved",
            entity_type="issue_recovery_action",
            entity_id=action.pk,
            run_id=run_id,
            details={
                "resolution": resolution,
                "note": note,
                "decidedHead": decided_head,
                "finalizationJobId": job_id,
            },
        )
    return ConflictResolution(run_id, action_id, resolution, job_id=job_id)


def _head_for_decision(
    run: HeartbeatRun, issue_id: UUID, expected: HeadExpected | None
) -> str | None:
    """The head the board decides against; WorkspaceHeadMoved when it is not the one expected.
    Not locked: a run publishing right after is merged with the decision by the worker
    (the decided head is its base), so nothing it committed is lost."""
    workspace_id = run.execution_workspace_id or (
        Issue.objects.filter(pk=issue_id).values_list("execution_workspace_id", flat=True).first()
    )
    head = (
        ExecutionWorkspace.objects.filter(pk=workspace_id, company_id=run.company_id)
        .values_list("head_tree", flat=True)
        .first()
        if workspace_id is not None
        else None
    )
    if expected is not None and head != expected.tree:
        raise WorkspaceHeadMoved(
            f"The workspace head moved since the preview: it is now {head or 'empty'}. "
            "Nothing was resolved; read the preview again against this head.",
            head=head,
        )
    return head


def _issue_company(actor: Actor, issue_id: UUID) -> UUID:
    company_id = Issue.objects.filter(pk=issue_id).values_list("company_id", flat=True).first()
    if company_id is None or not actor.can_access(company_id):
        raise NotFoundError("Issue not found.")
    return company_id
