"""The board's resolutions of a workspace head conflict, as merges against the head of the
moment (docs/snapshots.md#conflicts), and the preview of each before the board decides.

A held run changed paths that the head changed too since the run's `base`. Every resolution
is a three-way merge of base→run and base→head, never a replacement: `publish` takes the run's
entry on each conflicting path, `keep_head` the head's, and both keep every other change of
both sides; `discard` commits the run without publishing anything.

The board decides against the head it saw (`decidedHead`, recorded with the resolution). The
worker publishes later, under finalization ownership: when the head is still that one, the
resolved tree becomes the head; when another run moved it since, the resolved tree is merged
with the head of now taking the decided head as the base, so the later runs' changes are kept
and the board's choice applies only to what it saw. A path that both the resolution and the
later runs changed is a new conflict: nothing is published and the run is held again, with a
new preview against the new head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal
from uuid import UUID

from paperclip.access import Actor
from paperclip.errors import NotFoundError
from paperclip.ids import parse_uuid
from paperclip.models import ExecutionWorkspace, HeartbeatRun, Issue
from paperclip.snapshots.cas import cas_store_blobs
from paperclip.snapshots.counts import counts_of, tree_counts_record
from paperclip.snapshots.diff import Change, changes_between, entry_json, path_key
from paperclip.snapshots.head import PublishError, PublishPlan, tree_entries
from paperclip.snapshots.merge import MAX_CONFLICTS, changed_paths, merge3, merge3_taking
from paperclip.snapshots.trees import Entry, TreeInvalid, build, check_symlinks
from recovery.errors import WorkspaceConflictUnreadable
from recovery.models import IssueRecoveryAction
from recovery.selectors.actions import HEAD_CONFLICT_CODE

type Resolution = Literal["publish", "keep_head", "discard"]
type MergingResolution = Literal["publish", "keep_head"]

RESOLUTIONS: Final[tuple[Resolution, ...]] = ("publish", "keep_head", "discard")
MAX_PREVIEW_CHANGES: Final = 1000


class ResolutionUnbuildable(Exception):
    """The resolved entries break a rule of trees (a symlink that escapes only once both
    sides' changes are together): the resolution cannot be published as such."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path or '/'}: {reason}")
        self.path = path
        self.reason = reason


def resolved_entries(
    base: dict[str, Entry],
    run: dict[str, Entry],
    head: dict[str, Entry],
    resolution: MergingResolution,
) -> dict[str, Entry]:
    """The entries `resolution` publishes against `head`: the three-way merge with each
    conflicting path taking the run's side (`publish`) or the head's (`keep_head`). Raises
    ResolutionUnbuildable when the result breaks a rule of trees."""
    merged = merge3_taking(base, run, head, side="ours" if resolution == "publish" else "theirs")
    try:
        check_symlinks(merged)
    except TreeInvalid as exc:
        raise ResolutionUnbuildable(exc.path, exc.reason) from exc
    return merged


# --- the preview ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Outcome:
    tree: str | None  # the tree the resolution would publish now (None: it cannot be built)
    changes: list[Change]
    error: str | None = None

    def as_json(self) -> dict[str, Any]:
        shown = [change.as_json() for change in self.changes[:MAX_PREVIEW_CHANGES]]
        body: dict[str, Any] = {
            "tree": self.tree,
            "changes": shown,
            "truncated": len(self.changes) > MAX_PREVIEW_CHANGES,
        }
        if self.error is not None:
            body["error"] = self.error
        return body

    def counts(self) -> dict[str, int]:
        counted = {"added": 0, "removed": 0, "modified": 0}
        for change in self.changes:
            counted[change.change] += 1
        return counted


@dataclass(frozen=True, slots=True)
class Conflict:
    path: str
    base: Entry | None
    head: Entry | None
    run: Entry | None

    def as_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "base": entry_json(self.base),
            "head": entry_json(self.head),
            "run": entry_json(self.run),
        }


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
    head = _head_of(company_id, held.workspace_id)
    try:
        base, run, now = _three_sides(company_id, held.base, held.tree, head)
    except PublishError as exc:
        raise WorkspaceConflictUnreadable(code=exc.code, reason=str(exc)) from exc
    plain = merge3(base, run, now)
    outcomes: dict[MergingResolution, Outcome] = {}
    for resolution in ("publish", "keep_head"):
        try:
            entries = resolved_entries(base, run, now, resolution)
        except ResolutionUnbuildable as exc:
            outcomes[resolution] = Outcome(None, [], error=str(exc))
            continue
        outcomes[resolution] = Outcome(build(entries)[0], changes_between(now, entries))
    return ConflictPreview(
        action_id=held.action.pk,
        run_id=held.run_id,
        workspace_id=held.workspace_id,
        base=held.base,
        head=head,
        tree=held.tree,
        conflicts=[
            Conflict(path, base.get(path), now.get(path), run.get(path)) for path in plain.conflicts
        ],
        conflict_count=plain.conflict_count,
        outcomes=outcomes,
    )


def _three_sides(
    company_id: UUID, base: str | None, tree: str, head: str | None
) -> tuple[dict[str, Entry], dict[str, Entry], dict[str, Entry]]:
    try:
        based = tree_entries(company_id, base)
    except PublishError:
        based = {}  # collected while the run worked: as publishing, every overlap conflicts
    return based, tree_entries(company_id, tree), tree_entries(company_id, head)


def _head_of(company_id: UUID, workspace_id: UUID) -> str | None:
    head: str | None = (
        ExecutionWorkspace.objects.filter(pk=workspace_id, company_id=company_id)
        .values_list("head_tree", flat=True)
        .first()
    )
    return head


# --- the worker's plan ----------------------------------------------------------------------


def resolution_plan(
    *,
    company_id: UUID,
    workspace_id: UUID,
    tree: str,
    base: str | None,
    resolution: MergingResolution,
    decided_head: str | None,
) -> PublishPlan:
    """What committing a run the board resolved does to the head, read now (no lock; the
    commit moves the head by compare-and-set on the head read here). The resolution applied
    against the head the board decided on; when the head moved since, that result merged with
    the head of now (the decided head as the base): kind `resolved` with the new head, or
    `conflict` with the paths both changed (the run is held again). The new tree's
    directories are stored here. Raises PublishError when a tree is unreadable."""
    head = _head_of(company_id, workspace_id)

    def plan(
        kind: Literal["resolved", "conflict"],
        new_head: str | None,
        conflicts: tuple[str, ...] = (),
        count: int = 0,
    ) -> PublishPlan:
        return PublishPlan(
            kind=kind,
            workspace_id=workspace_id,
            tree=tree,
            base=base,
            expected_head=head,
            new_head=new_head,
            conflicts=conflicts,
            conflict_count=count,
            resolution=resolution,
            decided_head=decided_head,
        )

    based, run, now = _three_sides(company_id, base, tree, head)
    try:
        decided = now if decided_head == head else tree_entries(company_id, decided_head)
    except PublishError:
        # The tree the board decided on is gone from the store: what it saw cannot be
        # compared any more, so the board decides again against the head of now.
        plain = merge3(based, run, now)
        paths = plain.conflicts or tuple(
            sorted(changed_paths(based, run), key=path_key)[:MAX_CONFLICTS]
        )
        return plan("conflict", None, paths, plain.conflict_count or len(paths))
    try:
        entries = resolved_entries(based, run, decided, resolution)
    except ResolutionUnbuildable as exc:
        return plan("conflict", None, (exc.path,), 1)
    if head != decided_head:
        later = merge3(decided, entries, now)
        if later.entries is None:
            return plan("conflict", None, later.conflicts, later.conflict_count)
        try:
            check_symlinks(later.entries)
        except TreeInvalid as exc:
            return plan("conflict", None, (exc.path,), 1)
        entries = later.entries
    root, blobs = build(entries)
    if root == head:
        return plan("resolved", head)
    cas_store_blobs(company_id=company_id, blobs=blobs)
    tree_counts_record(company_id=company_id, tree=root, counts=counts_of(entries))
    return plan("resolved", root)
