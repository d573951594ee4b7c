"""Publishing, and the board's resolutions, when the run's base is gone from the store
(collected while the run worked): every path where the run's tree and the head differ is held
for the board, none merged on a guess (docs/snapshots.md#merging)."""

from __future__ import annotations

import pytest

from paperclip.models import Company, ExecutionWorkspace
from paperclip.snapshots.head import publish_plan, tree_entries
from paperclip.snapshots.merge import merge3, unknown_base
from paperclip.snapshots.resolutions import resolution_sides
from paperclip.snapshots.trees import build
from tests.paperclip.factories import ExecutionWorkspaceFactory
from tests.recovery.snapshots import entries_of, store_tree

pytestmark = pytest.mark.django_db


def test_a_run_s_deletions_are_held_not_undone_when_its_base_is_gone(company: Company) -> None:
    """Read as empty, the base made the run's deletions (b, d/e) look like the head's
    additions: merged, the new head had them back and the board never heard of it."""
    workspace = ExecutionWorkspaceFactory(company=company, cwd=None)
    files = {"a": b"x", "b": b"y", "d/e": b"e"}
    base, _ = build(entries_of(company.pk, files, store=False))  # never stored: as collected
    run = store_tree(company.pk, {"a": b"x"})
    head = store_tree(company.pk, {**files, "c": b"z"})
    ExecutionWorkspace.objects.filter(pk=workspace.pk).update(head_tree=head)

    plan = publish_plan(company_id=company.pk, workspace_id=workspace.pk, tree=run, base=base)

    assert plan.kind == "conflict"
    assert set(plan.conflicts) == {"b", "c", "d", "d/e"}
    based, ours, theirs = resolution_sides(company.pk, base, run, head)
    assert set(merge3(based, ours, theirs).conflicts) == {"b", "c", "d", "d/e"}


def test_without_a_base_only_what_the_sides_agree_on_merges(company: Company) -> None:
    ours = tree_entries(company.pk, store_tree(company.pk, {"same": b"1", "mine": b"2"}))
    theirs = tree_entries(company.pk, store_tree(company.pk, {"same": b"1", "mine": b"3"}))
    merged = merge3(unknown_base(ours, theirs), ours, theirs)
    assert merged.conflicts == ("mine",)
    agreed = merge3(unknown_base(ours, ours), ours, ours)
    assert agreed.entries == ours
