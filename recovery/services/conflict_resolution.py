"""The preview of a workspace head conflict hold's resolutions before the board decides
(docs/snapshots.md#conflicts): the hold read from recovery's actions, the resolutions computed
from trees alone by `paperclip.snapshots.resolutions`, which also plans the worker's publish of
the board's decision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from uuid import UUID

from paperclip.access import Actor
from paperclip.errors import NotFoundError
from paperclip.ids import parse_uuid
from paperclip.models import HeartbeatRun, Issue
from paperclip.snapshots.head import PublishError
from paperclip.snapshots.resolutions import (
    Conflict,
    MergingResolution,
    Outcome,
    resolution_preview,
    resolution_sides,
    workspace_head,
)
from recovery.errors import WorkspaceConflictUnreadable
from recovery.models import IssueRecoveryAction
from recovery.selectors.actions import HEAD_CONFLICT_CODE


@dataclass(frozen=True, slots=True)
class ConflictPreview:
    action_id: UUID
    run_id: UUID
    workspace_id: UUID
    base: str | None
    head: str | None  # the head of now, which every outcome is relative to
    tree: str  # the run's snapshot
    conflicts: list[Conflict]  # at most MAX_CONFLICTS, sorted by path
    conflict_count: int
    outcomes: dict[MergingResolution, Outcome]

    def as_json(self) -> dict[str, Any]:
        return {
            "action_id": str(self.action_id),
            "run_id": str(self.run_id),
            "base": self.base,
            "head": self.head,
            "tree": self.tree,
            "conflicts": [conflict.as_json() for conflict in self.conflicts],
            "conflict_count": self.conflict_count,
            "outcomes": {name: outcome.as_json() for name, outcome in self.outcomes.items()},
        }


@dataclass(frozen=True, slots=True)
class HeldConflict:
    """A conflict hold with the run and workspace it names."""

    action: IssueRecoveryAction
    run_id: UUID
    workspace_id: UUID
    tree: str
    base: str | None


def held_conflict(*, actor: Actor, issue_id: UUID, action_id: UUID) -> HeldConflict:
    """The workspace conflict hold `action_id` of the issue, as `actor` may see it: NotFound
    for another company's, another issue's, or an action that is not a conflict hold."""
    action = (
        IssueRecoveryAction.objects.filter(
            pk=action_id, source_issue_id=issue_id, cause=HEAD_CONFLICT_CODE
        )
        .select_related("source_issue")
        .first()
    )
    if action is None or not actor.can_access(action.company_id):
        raise NotFoundError("Workspace conflict not found.")
    evidence = action.evidence if isinstance(action.evidence, dict) else {}
    run_id = parse_uuid(evidence.get("runId"))
    run = (
        HeartbeatRun.objects.filter(pk=run_id, company_id=action.company_id).first()
        if run_id is not None
        else None
    )
    tree = evidence.get("tree")
    if run is None or not isinstance(tree, str):
        raise NotFoundError("Workspace conflict not found.")
    workspace_id = run_workspace_id(run, action.source_issue)
    if workspace_id is None:
        raise NotFoundError("Workspace conflict not found.")
    base = evidence.get("base")
    return HeldConflict(action, run.pk, workspace_id, tree, base if isinstance(base, str) else None)


def run_workspace_id(run: HeartbeatRun, issue: Issue) -> UUID | None:
    return run.execution_workspace_id or issue.execution_workspace_id


def workspace_conflict_preview(*, actor: Actor, issue_id: UUID, action_id: UUID) -> ConflictPreview:
    """What each resolution of the conflict hold would publish against the head of now: the
    conflicting paths with each side's entry, and per resolution the tree and its changes
    relative to that head. Reads only (nothing is stored: the trees are named, not kept).
    Raises NotFound (see `held_conflict`) or WorkspaceConflictUnreadable when a tree is no
    longer readable from the store."""
    held = held_conflict(actor=actor, issue_id=issue_id, action_id=action_id)
    company_id = held.action.company_id
    head = workspace_head(company_id, held.workspace_id)
    try:
        base, run, now = resolution_sides(company_id, held.base, held.tree, head)
    except PublishError as exc:
        raise WorkspaceConflictUnreadable(code=exc.code, reason=str(exc)) from exc
    preview = resolution_preview(base, run, now)
    return ConflictPreview(
        action_id=held.action.pk,
        run_id=held.run_id,
        workspace_id=held.workspace_id,
        base=held.base,
        head=head,
        tree=held.tree,
        conflicts=preview.conflicts,
        conflict_count=preview.conflict_count,
        outcomes=preview.outcomes,
    )
