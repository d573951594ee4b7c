"""Every move of a head is recorded in the transaction that moves it, by whoever moved it
(docs/snapshots.md#history): a run's publish, a merge, an adopted cwd, the board's resolution
of a conflict, and the board's restore, which the cwd follows and a run working meanwhile
merges with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from paperclip.models import ExecutionWorkspace
from paperclip.snapshots.disk_tree import read_tree
from paperclip.snapshots.models import WorkspaceHeadMove
from paperclip.snapshots.trees import build
from tests.helpers import run_jobs
from tests.recovery.conflicts import files_of, finalize, head_of, in_workspace, live_hold, resolve
from tests.recovery.factories import make_binding
from tests.recovery.snapshots import Files, snapshot_result, store_tree

pytestmark = pytest.mark.django_db(transaction=True)

BASE: Files = {"README.md": b"hello\n", "src/main.py": b"print('hi')\n"}


def _moves(workspace_id: Any) -> list[WorkspaceHeadMove]:
    return list(WorkspaceHeadMove.objects.filter(workspace_id=workspace_id).order_by("seq"))


def test_publish_merge_and_adoption_are_recorded_with_their_run_and_counts(
    tmp_path: Path,
) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "README.md").write_text("hello\n")
    a = make_binding()
    a.workspace.cwd = str(cwd)
    a.workspace.save(update_fields=["cwd"])
    ours = store_tree(a.company.pk, {**BASE, "a.txt": b"a\n"})
    assert a.result is not None
    snapshot_result(a.run, a.result, ours, None)
    assert finalize(a).published.kind == "merged"  # with the adopted cwd
    b = in_workspace(a, {**BASE, "a.txt": b"a\n", "b.txt": b"b\n"}, base=head_of(a))
    assert finalize(b).published.kind == "fast_forward"

    adopted, merged, published = _moves(a.workspace.pk)
    assert (adopted.seq, adopted.kind, adopted.actor_type, adopted.run_id) == (
        1,
        "adoption",
        "system",
        None,
    )
    assert (adopted.previous_tree, adopted.added) == (None, 1)
    assert (merged.kind, merged.run_id, merged.actor_type, merged.actor_id) == (
        "merge",
        a.run.pk,
        "agent",
        str(a.run.agent_id),
    )
    assert merged.previous_tree == adopted.tree
    assert (merged.added, merged.removed, merged.modified) == (3, 0, 0)  # src, its file, a.txt
    assert (published.kind, published.run_id, published.tree) == ("publish", b.run.pk, head_of(a))
    assert (published.added, published.removed, published.modified) == (1, 0, 0)


def test_the_boards_resolution_is_recorded_with_its_action_and_who_decided(
    tmp_path: Path, make_board_client: Any
) -> None:
    a = make_binding()
    base = store_tree(a.company.pk, BASE)
    theirs = store_tree(a.company.pk, {**BASE, "README.md": b"theirs\n"})
    a.workspace.cwd = str(tmp_path / "cwd")
    a.workspace.head_tree = theirs
    a.workspace.save(update_fields=["cwd", "head_tree"])
    assert a.result is not None
    snapshot_result(
        a.run, a.result, store_tree(a.company.pk, {**BASE, "README.md": b"ours\n"}), base
    )
    assert finalize(a).status == "held"
    hold = live_hold(a)
    board = make_board_client(a.company)
    assert resolve(board, a, "publish").status_code == 202
    run_jobs()

    (move,) = _moves(a.workspace.pk)
    assert (move.kind, move.action_id, move.run_id) == ("resolution", hold.pk, a.run.pk)
    assert (move.actor_type, move.actor_id) == ("board", str(board.user.pk))
    assert (move.previous_tree, move.tree) == (theirs, head_of(a))
    assert (move.added, move.removed, move.modified) == (0, 0, 1)


def test_a_restore_is_materialized_and_a_run_working_meanwhile_merges_with_it(
    tmp_path: Path, make_board_client: Any
) -> None:
    a = make_binding()
    a.workspace.cwd = str(tmp_path / "cwd")
    a.workspace.save(update_fields=["cwd"])
    assert a.result is not None
    snapshot_result(a.run, a.result, store_tree(a.company.pk, BASE), None)
    finalize(a)
    good = head_of(a)
    bad = in_workspace(a, {**BASE, "README.md": b"broken\n"}, base=good)
    finalize(bad)
    # A run started from the bad head, still working while the board restores.
    late = in_workspace(
        a, {**BASE, "README.md": b"broken\n", "late.txt": b"late\n"}, base=head_of(a)
    )
    board = make_board_client(a.company)

    response = board.post(
        f"/api/execution-workspaces/{a.workspace.pk}/restore",
        {"tree": good, "expected_head": head_of(a), "note": "the README change broke the docs"},
        format="json",
    )

    assert response.status_code == 200, response.content
    assert head_of(a) == good
    run_jobs()  # the restore deferred the materialization
    workspace = ExecutionWorkspace.objects.get(pk=a.workspace.pk)
    assert workspace.cwd_tree == good
    assert build(read_tree(str(tmp_path / "cwd")))[0] == good
    # The late run's README change was the bad run's, undone by the restore; its own file is
    # merged in: it changed README from its base (bad) too, so README is the late run's.
    assert finalize(late).published.kind == "merged"
    assert files_of(a, head_of(a))["late.txt"] == b"late\n"
    kinds = [(m.seq, m.kind) for m in _moves(a.workspace.pk)]
    assert kinds == [(1, "publish"), (2, "publish"), (3, "restore"), (4, "merge")]
