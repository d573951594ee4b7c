"""The board's resolutions of a workspace head conflict, computed from trees alone: the
entries each resolution publishes, their preview against the head of now, and the worker's
plan (docs/snapshots.md#conflicts). The hold they resolve is recovery's
(`recovery.services.conflicts`, `recovery.services.conflict_resolution`).

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

from paperclip.models import ExecutionWorkspace
from paperclip.snapshots.counts import counts_of, tree_counts_record
from paperclip.snapshots.diff import Change, changes_between, entry_json, path_key
from paperclip.snapshots.head import PublishError, PublishPlan, tree_entries
from paperclip.snapshots.merge import (
    MAX_CONFLICTS,
    changed_paths,
    merge3,
    merge3_taking,
    unknown_base,
)
from paperclip.snapshots.store.uploads import cas_store_blobs
from paperclip.snapshots.trees import Entry, TreeInvalid, build, check_symlinks

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


def resolution_sides(
    company_id: UUID, base: str | None, tree: str, head: str | None
) -> tuple[dict[str, Entry], dict[str, Entry], dict[str, Entry]]:
    """The entries of the base, the run's tree and the head. A base gone from the store reads
    as publishing reads it: every path where the run's tree and the head differ as changed by
    both (`unknown_base`). Raises PublishError when the tree or head is unreadable."""
    ours, theirs = tree_entries(company_id, tree), tree_entries(company_id, head)
    try:
        based = tree_entries(company_id, base)
    except PublishError:
        based = unknown_base(ours, theirs)  # collected while the run worked
    return based, ours, theirs


def workspace_head(company_id: UUID, workspace_id: UUID) -> str | None:
    head: str | None = (
        ExecutionWorkspace.objects.filter(pk=workspace_id, company_id=company_id)
        .values_list("head_tree", flat=True)
        .first()
    )
    return head


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
class ResolutionPreview:
    conflicts: list[Conflict]  # at most MAX_CONFLICTS, sorted by path
    conflict_count: int
    outcomes: dict[MergingResolution, Outcome]


def resolution_preview(
    base: dict[str, Entry], run: dict[str, Entry], now: dict[str, Entry]
) -> ResolutionPreview:
    """The conflicting paths with each side's entry, and per merging resolution the tree it
    would publish against `now` and its changes relative to `now` (the trees are named, not
    stored)."""
    plain = merge3(base, run, now)
    outcomes: dict[MergingResolution, Outcome] = {}
    for resolution in ("publish", "keep_head"):
        try:
            entries = resolved_entries(base, run, now, resolution)
        except ResolutionUnbuildable as exc:
            outcomes[resolution] = Outcome(None, [], error=str(exc))
            continue
        outcomes[resolution] = Outcome(build(entries)[0], changes_between(now, entries))
    return ResolutionPreview(
        conflicts=[
            Conflict(path, base.get(path), now.get(path), run.get(path)) for path in plain.conflicts
        ],
        conflict_count=plain.conflict_count,
        outcomes=outcomes,
    )


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
    head = workspace_head(company_id, workspace_id)

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

    based, run, now = resolution_sides(company_id, base, tree, head)
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
