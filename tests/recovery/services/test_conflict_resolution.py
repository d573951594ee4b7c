"""The board's resolutions of a workspace head conflict, each a merge against the head of the
moment: runs that committed after the hold keep their work whatever the board decides, the
preview names what each resolution then publishes, and `expected_head` refuses a head that
moved (docs/snapshots.md#conflicts)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from rest_framework.test import APIClient

from paperclip.models import ActivityEvent, NativeRunFinalization
from paperclip.snapshots.disk_tree import read_tree
from paperclip.snapshots.head import workspace_materialize
from paperclip.snapshots.resolutions import resolution_plan
from paperclip.snapshots.trees import build
from recovery.models import IssueRecoveryAction
from recovery.selectors.finalization import finalization_state
from tests.helpers import run_jobs
from tests.paperclip.helpers import audit_count
from tests.recovery.conflicts import (
    NOTE,
    files_of,
    finalize,
    head_of,
    held_then_two_commits,
    in_workspace,
    live_hold,
    resolve,
)
from tests.recovery.factories import Binding, make_binding

pytestmark = pytest.mark.django_db(transaction=True)


def _preview(board: APIClient, b: Binding, hold: IssueRecoveryAction) -> Any:
    return board.get(f"/api/issues/{b.issue.pk}/recovery-actions/{hold.pk}/conflict")


def _cwd_equalshead(b: Binding, tmp_path: Path) -> None:
    workspace_materialize(workspace_id=b.workspace.pk)
    assert build(read_tree(str(tmp_path / "cwd")))[0] == head_of(b)


def test_publishing_a_held_run_keeps_the_work_of_runs_that_committed_after_thehold(
    tmp_path: Path, make_board_client: Any
) -> None:
    a, _tree = held_then_two_commits(tmp_path)
    board = make_board_client(a.company)
    assert resolve(board, a, "publish").status_code == 202
    run_jobs()
    assert NativeRunFinalization.objects.get(pk=a.run.pk).phase == "committed"
    # A's side of README, A's own changes, and everything B and C committed after the hold.
    assert files_of(a, head_of(a)) == {
        "README.md": b"A's README\n",
        "a.txt": b"a\n",
        "b.txt": b"b\n",
        "c.txt": b"c\n",
        "notes/guide.md": b"guide\n",
    }
    assert audit_count("workspace.head_published") == 4  # X, B, C, then the resolution
    _cwd_equalshead(a, tmp_path)
    assert (tmp_path / "cwd" / "b.txt").read_bytes() == b"b\n"
    assert (tmp_path / "cwd" / "c.txt").read_bytes() == b"c\n"


def test_keep_head_keeps_the_heads_side_and_still_publishes_the_runs_other_changes(
    tmp_path: Path, make_board_client: Any
) -> None:
    a, _tree = held_then_two_commits(tmp_path)
    board = make_board_client(a.company)
    assert resolve(board, a, "keep_head").status_code == 202
    run_jobs()
    assert files_of(a, head_of(a)) == {
        "README.md": b"X's README\n",
        "a.txt": b"a\n",
        "b.txt": b"b\n",
        "c.txt": b"c\n",
        "notes/guide.md": b"guide\n",
    }
    _cwd_equalshead(a, tmp_path)


def test_discard_commits_the_run_and_publishes_nothing(
    tmp_path: Path, make_board_client: Any
) -> None:
    a, _tree = held_then_two_commits(tmp_path)
    before = head_of(a)
    board = make_board_client(a.company)
    assert resolve(board, a, "discard").status_code == 202
    published = audit_count("workspace.head_published")
    run_jobs()
    assert NativeRunFinalization.objects.get(pk=a.run.pk).phase == "committed"
    assert head_of(a) == before
    assert audit_count("workspace.head_published") == published


@pytest.mark.parametrize("resolution", ["publish", "keep_head"])
def test_the_preview_names_exactly_what_each_resolution_then_publishes(
    tmp_path: Path, make_board_client: Any, resolution: str
) -> None:
    a, a_tree = held_then_two_commits(tmp_path)
    board = make_board_client(a.company)
    hold = live_hold(a)
    writes = ActivityEvent.objects.count()
    response = _preview(board, a, hold)
    assert response.status_code == 200, response.content
    assert ActivityEvent.objects.count() == writes  # a read writes nothing
    preview = response.json()
    head = head_of(a)
    assert (preview["run_id"], preview["tree"], preview["head"]) == (str(a.run.pk), a_tree, head)
    # README was changed on both sides; src/main.py removed by A and kept by the head is not.
    conflicts = preview["conflicts"]
    assert [c["path"] for c in conflicts] == ["README.md"]
    assert conflicts[0]["base"]["type"] == "file"
    assert conflicts[0]["head"]["digest"] != conflicts[0]["run"]["digest"]
    changes = {
        name: {(c["path"], c["change"]) for c in outcome["changes"]}
        for name, outcome in preview["outcomes"].items()
    }
    assert changes == {
        "publish": {
            ("README.md", "modified"),
            ("a.txt", "added"),
            ("src", "removed"),
            ("src/main.py", "removed"),
        },
        "keep_head": {("a.txt", "added"), ("src", "removed"), ("src/main.py", "removed")},
    }
    removed = next(c for c in preview["outcomes"]["publish"]["changes"] if c["path"] == "src")
    assert removed == {
        "path": "src",
        "change": "removed",
        "from": {"type": "dir", "mode": 493},
        "to": None,
    }

    assert resolve(board, a, resolution, expected_head=head).status_code == 202
    run_jobs()
    assert head_of(a) == preview["outcomes"][resolution]["tree"]


def test_expected_head_refuses_a_head_that_moved_since_the_preview(
    tmp_path: Path, make_board_client: Any
) -> None:
    a, _tree = held_then_two_commits(tmp_path)
    board = make_board_client(a.company)
    seen = _preview(board, a, live_hold(a)).json()["head"]
    d = in_workspace(a, {**files_of(a, seen), "d.txt": b"d\n"}, base=seen)
    assert finalize(d).status == "committed"
    writes = ActivityEvent.objects.count()

    moved = resolve(board, a, "publish", expected_head=seen)

    assert moved.status_code == 409
    error = moved.json()["error"]
    assert (error["code"], error["details"]["head"]) == ("workspace_head_moved", head_of(a))
    assert ActivityEvent.objects.count() == writes
    assert live_hold(a).status == "active"
    # Decided against the head of now, with the same body repeated: one audit row.
    assert resolve(board, a, "publish", expected_head=head_of(a)).status_code == 202
    writes = ActivityEvent.objects.count()
    hold = IssueRecoveryAction.objects.get(cause="workspace_head_conflict", status="resolved")
    repeat = board.post(
        f"/api/issues/{a.issue.pk}/recovery-actions/resolve-workspace-conflict",
        {
            "action_id": str(hold.pk),
            "run_id": str(a.run.pk),
            "resolution": "publish",
            "expected_head": seen,  # the head moved again since: a repeat still answers
            "note": NOTE,
        },
        format="json",
    )
    assert repeat.status_code == 202
    assert ActivityEvent.objects.count() == writes
    run_jobs()
    assert files_of(a, head_of(a))["d.txt"] == b"d\n"


def test_a_head_moved_between_the_decision_and_the_publish_is_merged_not_dropped(
    tmp_path: Path, make_board_client: Any
) -> None:
    a, _tree = held_then_two_commits(tmp_path)
    board = make_board_client(a.company)
    decided = head_of(a)
    assert resolve(board, a, "publish", expected_head=decided).status_code == 202
    # Before the worker attempts A, run E commits another path.
    e = in_workspace(a, {**files_of(a, decided), "e.txt": b"e\n"}, base=decided)
    assert finalize(e).status == "committed"
    run_jobs()
    files = files_of(a, head_of(a))
    assert files["e.txt"] == b"e\n"
    assert files["README.md"] == b"A's README\n"
    assert files["b.txt"] == b"b\n"
    published = ActivityEvent.objects.filter(action="workspace.head_published").latest("created_at")
    assert published.details["resolution"] == "publish"
    assert published.details["decidedHead"] == decided


def test_a_new_conflict_after_the_decision_holds_the_run_again_with_a_new_preview(
    tmp_path: Path, make_board_client: Any
) -> None:
    a, _tree = held_then_two_commits(tmp_path)
    board = make_board_client(a.company)
    decided = head_of(a)
    assert resolve(board, a, "publish").status_code == 202
    # Run F adds a.txt too, differently: the board never saw that conflict.
    f = in_workspace(a, {**files_of(a, decided), "a.txt": b"F's a\n"}, base=decided)
    assert finalize(f).status == "committed"
    after_f = head_of(a)
    run_jobs()
    assert head_of(a) == after_f  # nothing of A published, nothing of F dropped
    a.run.refresh_from_db()
    state = finalization_state(a.run)
    assert (state.state, state.reason) == ("held", "workspace_head_conflict")
    hold = live_hold(a)
    assert hold.evidence["head"] == after_f
    assert hold.evidence["conflictingPaths"] == ["a.txt"]
    preview = _preview(board, a, hold).json()
    assert [c["path"] for c in preview["conflicts"]] == ["README.md", "a.txt"]
    # The board decides again; keep_head keeps F's a.txt and the head's README.
    assert resolve(board, a, "keep_head", expected_head=after_f).status_code == 202
    run_jobs()
    files = files_of(a, head_of(a))
    assert (files["a.txt"], files["README.md"]) == (b"F's a\n", b"X's README\n")
    assert "src/main.py" not in files  # A's other change is published


def test_the_preview_is_the_boards_of_this_company_only(
    tmp_path: Path, make_board_client: Any, make_agent_client: Any
) -> None:
    a, _tree = held_then_two_commits(tmp_path)
    hold = live_hold(a)
    agent = make_agent_client(a.agent)
    outsider = make_board_client(make_binding().company)
    board = make_board_client(a.company)
    elsewhere = f"/api/issues/{make_binding(company=a.company).issue.pk}/recovery-actions/"
    other = IssueRecoveryAction.objects.create(
        company=a.company,
        source_issue=a.issue,
        kind="workspace_validation",
        owner_type="board",
        cause="something_else",
        fingerprint="f",
        evidence={"runId": str(a.run.pk)},
        next_action="n",
        status="resolved",
    )
    writes = ActivityEvent.objects.count()
    assert _preview(agent, a, hold).status_code == 403
    stranger = _preview(outsider, a, hold)
    assert (stranger.status_code, stranger.json()["error"]["code"]) == (404, "not_found")
    assert _preview(board, a, other).status_code == 404
    assert board.get(f"{elsewhere}{hold.pk}/conflict").status_code == 404
    assert ActivityEvent.objects.count() == writes


def test_the_resolve_body_is_strict(tmp_path: Path, make_board_client: Any) -> None:
    a, _tree = held_then_two_commits(tmp_path)
    board = make_board_client(a.company)
    writes = ActivityEvent.objects.count()
    for extra, field in (
        ({"resolution": "replace"}, "resolution"),
        ({"expected_head": "HEAD"}, "expected_head"),
        ({"expected_head": 1}, "expected_head"),
        ({"force": True}, "force"),
    ):
        resolution = str(extra.pop("resolution", "publish"))
        refused = resolve(board, a, resolution, **extra)
        assert refused.status_code == 400, extra
        assert field in refused.json()["error"]["details"]["fields"]
    assert ActivityEvent.objects.count() == writes
    # An empty head expected where the workspace has one: moved.
    assert resolve(board, a, "publish", expected_head=None).status_code == 409


def test_a_head_moved_between_the_resolutions_plan_and_its_commit_is_planned_again(
    tmp_path: Path, make_board_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, _tree = held_then_two_commits(tmp_path)
    decided = head_of(a)
    board = make_board_client(a.company)
    assert resolve(board, a, "publish", expected_head=decided).status_code == 202
    g = in_workspace(a, {**files_of(a, decided), "g.txt": b"g\n"}, base=decided)
    planned: list[str | None] = []
    after_g: list[str | None] = []

    def plan_then_another_commit(**kwargs: Any) -> Any:
        plan = resolution_plan(**kwargs)
        planned.append(plan.expected_head)
        if len(planned) == 1:  # the race: G commits after A's plan, before A's commit
            assert finalize(g).status == "committed"
            after_g.append(head_of(a))
        return plan

    monkeypatch.setattr(
        "recovery.services.finalization.publish.resolution_plan", plan_then_another_commit
    )
    run_jobs()

    assert planned[0] == decided
    assert planned[1:] == after_g  # planned once more, against G's head
    files = files_of(a, head_of(a))
    assert (files["g.txt"], files["README.md"]) == (b"g\n", b"A's README\n")
    assert NativeRunFinalization.objects.get(pk=a.run.pk).phase == "committed"
