"""Publishing a run's snapshot under finalization ownership: fast-forward, the path-by-path
merge with another run's head, the board's conflict hold and its resolutions, and the
materialization of the head into the workspace's cwd (docs/snapshots.md#publishing)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
from django.test import override_settings
from rest_framework.test import APIClient

from paperclip.models import ActivityEvent, ExecutionWorkspace, NativeRunFinalization
from paperclip.snapshots.adopt import CwdUnadoptable, workspace_cwd_adopt
from paperclip.snapshots.disk_tree import read_tree
from paperclip.snapshots.head import workspace_materialize
from paperclip.snapshots.store.reads import cas_load
from paperclip.snapshots.trees import build, walk
from recovery.models import IssueRecoveryAction
from recovery.selectors.finalization import finalization_state
from recovery.services import Acquired, finalizations_reconcile, run_finalize
from tests.helpers import run_jobs
from tests.paperclip.helpers import audit_count
from tests.recovery.factories import Binding, make_binding
from tests.recovery.snapshots import Files, snapshot_result, store_tree

pytestmark = pytest.mark.django_db(transaction=True)

BASE: Files = {"README.md": b"hello\n", "src/main.py": b"print('hi')\n"}


def _binding(tmp_path: Path, files: Files, *, base: str | None, head: str | None) -> Binding:
    """A run with an accepted result naming a snapshot of `files` started from `base`, in a
    workspace whose head is `head` and whose cwd is `tmp_path/cwd`."""
    b = make_binding()
    b.workspace.cwd = str(tmp_path / "cwd")
    b.workspace.head_tree = head
    b.workspace.save(update_fields=["cwd", "head_tree"])
    tree = store_tree(b.company.pk, files)
    assert b.result is not None
    snapshot_result(b.run, b.result, tree, base)
    return b


def _finalize(b: Binding) -> Any:
    outcome = run_finalize(company_id=b.company.pk, run_id=b.run.pk)
    assert isinstance(outcome, Acquired), outcome
    return outcome.value


def _head_files(b: Binding) -> dict[str, bytes | str]:
    head = ExecutionWorkspace.objects.get(pk=b.workspace.pk).head_tree
    assert head is not None
    walked = walk(head, lambda n: cas_load(company_id=b.company.pk, digest=n, max_bytes=1 << 26))
    files: dict[str, bytes | str] = {}
    for path, entry in walked.entries.items():
        if entry.type == "file":
            assert entry.digest is not None
            data = cas_load(company_id=b.company.pk, digest=entry.digest, max_bytes=1 << 26)
            assert data is not None
            files[path] = data
        elif entry.type == "symlink":
            files[path] = entry.target
    return files


def test_a_snapshot_from_the_head_fast_forwards_it_in_the_commit_and_lands_in_the_cwd(
    tmp_path: Path,
) -> None:
    b = _binding(tmp_path, {**BASE, "new.txt": b"work\n"}, base=None, head=None)
    outcome = _finalize(b)
    assert outcome.status == "committed"
    assert outcome.published.kind == "fast_forward"
    workspace = ExecutionWorkspace.objects.get(pk=b.workspace.pk)
    assert workspace.head_tree == outcome.published.tree
    assert workspace.head_run_id == b.run.pk
    assert workspace.head_committed_at is not None
    assert audit_count("workspace.head_published") == 1
    # The commit deferred the materialization; the worker runs it.
    run_jobs()
    workspace.refresh_from_db()
    assert workspace.cwd_tree == workspace.head_tree
    assert build(read_tree(str(tmp_path / "cwd")))[0] == workspace.head_tree


def test_changes_to_disjoint_paths_merge_with_a_head_another_run_moved(tmp_path: Path) -> None:
    b = make_binding()
    base = store_tree(b.company.pk, BASE)
    theirs = store_tree(b.company.pk, {**BASE, "theirs.txt": b"t\n", "README.md": b"hello!\n"})
    b.workspace.cwd = str(tmp_path / "cwd")
    b.workspace.head_tree = theirs
    b.workspace.save(update_fields=["cwd", "head_tree"])
    ours = store_tree(b.company.pk, {"README.md": b"hello\n", "ours.txt": b"o\n"})
    assert b.result is not None
    snapshot_result(b.run, b.result, ours, base)

    outcome = _finalize(b)

    assert outcome.status == "committed"
    assert outcome.published.kind == "merged"
    # Theirs changed README and added a file; ours removed src/ and added a file.
    assert _head_files(b) == {"README.md": b"hello!\n", "theirs.txt": b"t\n", "ours.txt": b"o\n"}
    workspace_materialize(workspace_id=b.workspace.pk)
    assert sorted(os.listdir(tmp_path / "cwd")) == ["README.md", "ours.txt", "theirs.txt"]


def _conflicted(tmp_path: Path) -> tuple[Binding, str, str]:
    b = make_binding()
    base = store_tree(b.company.pk, BASE)
    theirs = store_tree(b.company.pk, {**BASE, "README.md": b"theirs\n"})
    b.workspace.cwd = str(tmp_path / "cwd")
    b.workspace.head_tree = theirs
    b.workspace.save(update_fields=["cwd", "head_tree"])
    ours = store_tree(b.company.pk, {**BASE, "README.md": b"ours\n"})
    assert b.result is not None
    snapshot_result(b.run, b.result, ours, base)
    return b, ours, theirs


def test_overlapping_changes_are_held_for_the_board_and_nothing_is_published(
    tmp_path: Path,
) -> None:
    b, _ours, theirs = _conflicted(tmp_path)
    outcome = _finalize(b)
    assert outcome.status == "held"
    assert outcome.failure_code == "workspace_head_conflict"
    assert ExecutionWorkspace.objects.get(pk=b.workspace.pk).head_tree == theirs
    hold = IssueRecoveryAction.objects.get(cause="workspace_head_conflict")
    assert hold.owner_type == "board"
    assert hold.evidence["runId"] == str(b.run.pk)
    assert hold.evidence["conflictingPaths"] == ["README.md"]
    b.run.refresh_from_db()
    state = finalization_state(b.run)
    assert (state.state, state.reason) == ("held", "workspace_head_conflict")
    assert b.run.status == "running"
    # Held runs wait for the board, not for the reconciler; an explicit attempt publishes
    # nothing and records no second hold.
    assert finalizations_reconcile().deferred == 0
    assert _finalize(b).status == "held"
    assert IssueRecoveryAction.objects.count() == 1
    assert ExecutionWorkspace.objects.get(pk=b.workspace.pk).head_tree == theirs


@pytest.mark.parametrize("resolution", ["publish", "discard"])
def test_the_board_resolves_a_conflict_by_publishing_or_discarding_the_runs_tree(
    tmp_path: Path, make_board_client: Any, resolution: str
) -> None:
    b, ours, theirs = _conflicted(tmp_path)
    _finalize(b)
    hold = IssueRecoveryAction.objects.get(cause="workspace_head_conflict")
    board: APIClient = make_board_client(b.company)
    body = {
        "action_id": str(hold.pk),
        "run_id": str(b.run.pk),
        "resolution": resolution,
        "note": "ours is the one the reviewer approved",
    }
    url = f"/api/issues/{b.issue.pk}/recovery-actions/resolve-workspace-conflict"
    response = board.post(url, body, format="json")
    assert response.status_code == 202, response.content
    assert response.json()["status"] == "queued"
    # A repeat answers the same and writes nothing.
    writes = ActivityEvent.objects.count()
    assert board.post(url, body, format="json").status_code == 202
    assert ActivityEvent.objects.count() == writes
    # The other resolution of a resolved hold is stale.
    other = {**body, "resolution": "discard" if resolution == "publish" else "publish"}
    stale = board.post(url, other, format="json")
    assert stale.status_code == 409
    assert stale.json()["error"]["code"] == "workspace_conflict_stale"

    out = run_jobs()  # the resolution deferred the finalization job

    coordinator = NativeRunFinalization.objects.get(pk=b.run.pk)
    assert coordinator.phase == "committed", out
    head = ExecutionWorkspace.objects.get(pk=b.workspace.pk).head_tree
    assert head == (ours if resolution == "publish" else theirs)


def test_a_resolution_naming_another_run_or_from_an_agent_changes_nothing(
    tmp_path: Path, make_board_client: Any, make_agent_client: Any
) -> None:
    b, _ours, _theirs = _conflicted(tmp_path)
    _finalize(b)
    hold = IssueRecoveryAction.objects.get(cause="workspace_head_conflict")
    url = f"/api/issues/{b.issue.pk}/recovery-actions/resolve-workspace-conflict"
    body = {"action_id": str(hold.pk), "run_id": str(b.run.pk), "resolution": "publish"}
    board: APIClient = make_board_client(b.company)
    agent_client = make_agent_client(b.agent)
    outsider = make_board_client(make_binding().company)
    writes = ActivityEvent.objects.count()
    wrong_run = board.post(url, {**body, "note": "n", "run_id": str(hold.pk)}, format="json")
    assert wrong_run.json()["error"]["code"] == "workspace_conflict_stale"
    missing_note = board.post(url, body, format="json")
    assert missing_note.status_code == 400
    agent = agent_client.post(url, {**body, "note": "n"}, format="json")
    assert agent.status_code == 403
    assert outsider.post(url, {**body, "note": "n"}, format="json").status_code == 404
    assert ActivityEvent.objects.count() == writes
    assert IssueRecoveryAction.objects.get(pk=hold.pk).status == "active"


def test_materialization_touches_only_what_changed_and_removes_what_went(tmp_path: Path) -> None:
    first = _binding(tmp_path, BASE, base=None, head=None)
    _finalize(first)
    workspace_materialize(workspace_id=first.workspace.pk)
    cwd = tmp_path / "cwd"
    kept = (cwd / "README.md").stat()
    second = make_binding(company=first.company)
    head = ExecutionWorkspace.objects.get(pk=first.workspace.pk).head_tree
    second.run.execution_workspace = first.workspace
    second.run.save(update_fields=["execution_workspace"])
    tree = store_tree(first.company.pk, {"README.md": b"hello\n", "src/app.py": b"app\n"})
    assert second.result is not None
    snapshot_result(second.run, second.result, tree, head)
    assert _finalize(second).published.kind == "fast_forward"
    outcome = workspace_materialize(workspace_id=first.workspace.pk)
    assert outcome.status == "materialized"
    assert sorted(os.listdir(cwd / "src")) == ["app.py"]
    assert (cwd / "README.md").stat().st_ino == kept.st_ino  # untouched
    assert audit_count("workspace.materialized") == 2
    # At the head already: nothing to do, nothing written.
    writes = ActivityEvent.objects.count()
    assert workspace_materialize(workspace_id=first.workspace.pk).status == "current"
    assert ActivityEvent.objects.count() == writes


@override_settings(PAPERCLIP_CAS_BACKEND="postgres")
def test_publishing_works_the_same_with_blobs_in_the_database(tmp_path: Path) -> None:
    b = _binding(tmp_path, BASE, base=None, head=None)
    assert _finalize(b).status == "committed"
    workspace_materialize(workspace_id=b.workspace.pk)
    assert (tmp_path / "cwd" / "src" / "main.py").read_bytes() == b"print('hi')\n"


def test_files_already_in_a_cwd_without_a_head_are_adopted_and_merged_not_wiped(
    tmp_path: Path,
) -> None:
    cwd = tmp_path / "cwd"
    (cwd / "notes").mkdir(parents=True)
    (cwd / "notes" / "guide.md").write_text("existing work\n")
    (cwd / "README.md").write_text("hello\n")
    b = _binding(
        tmp_path, {"README.md": b"hello\n", "new.txt": b"run's work\n"}, base=None, head=None
    )

    outcome = _finalize(b)

    assert outcome.published.kind == "merged"
    assert audit_count("workspace.head_adopted") == 1
    assert _head_files(b) == {
        "README.md": b"hello\n",
        "notes/guide.md": b"existing work\n",
        "new.txt": b"run's work\n",
    }
    workspace_materialize(workspace_id=b.workspace.pk)
    assert (cwd / "notes" / "guide.md").read_text() == "existing work\n"
    assert (cwd / "new.txt").read_text() == "run's work\n"


def test_an_adopted_cwd_that_disagrees_with_the_first_run_is_a_conflict(tmp_path: Path) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "README.md").write_text("the operator's version\n")
    b = _binding(tmp_path, {"README.md": b"the agent's version\n"}, base=None, head=None)
    assert _finalize(b).status == "held"
    hold = IssueRecoveryAction.objects.get(cause="workspace_head_conflict")
    assert hold.evidence["conflictingPaths"] == ["README.md"]
    assert (cwd / "README.md").read_text() == "the operator's version\n"


def test_the_console_resolves_a_conflict_with_the_same_service(
    tmp_path: Path, superuser_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("recovery.admin.actions.RESOLVE_WAIT_SECONDS", 0.0)  # no worker here
    b, ours, _theirs = _conflicted(tmp_path)
    _finalize(b)
    hold = IssueRecoveryAction.objects.get(cause="workspace_head_conflict")
    url = "/admin/recovery/issuerecoveryaction/"
    detail = superuser_client.get(f"{url}{hold.pk}/change/")
    assert b"Resolve workspace conflict" in detail.content
    assert b"Recovery source inspection" not in detail.content  # not what a conflict is about
    page = superuser_client.post(
        url, {"action": "resolve_workspace_conflict", "_selected_action": [str(hold.pk)]}
    )
    assert page.status_code == 200
    assert b"README.md" in page.content  # the conflicting path is shown before deciding
    previewed = re.search(rf'name="expected_head_{hold.pk}" value="([^"]+)"', page.content.decode())
    assert previewed is not None  # the page posts back the head it showed, as a browser does
    done = superuser_client.post(
        url,
        {
            "action": "resolve_workspace_conflict",
            "_selected_action": [str(hold.pk)],
            "apply": "1",
            "resolution": "publish",
            "note": "the reviewer approved this run",
            f"expected_head_{hold.pk}": previewed.group(1),
        },
        follow=True,
    )
    assert b"Resolved 1 (publish)" in done.content
    run_jobs()
    assert ExecutionWorkspace.objects.get(pk=b.workspace.pk).head_tree == ours
    detail = superuser_client.get(f"{url}{hold.pk}/change/")
    assert b"Resolve workspace conflict" not in detail.content  # resolved: no button any more


def test_links_that_escape_only_together_make_a_merge_a_conflict(tmp_path: Path) -> None:
    b = make_binding()
    base = store_tree(b.company.pk, {"x/keep": b"k\n"})
    # Theirs turns x into a link to the root (fine alone); ours adds a link through x/.. (fine
    # alone, x being a directory): together `a` would resolve above the root.
    theirs = store_tree(b.company.pk, {"x": "."})
    b.workspace.head_tree = theirs
    b.workspace.save(update_fields=["head_tree"])
    ours = store_tree(b.company.pk, {"x/keep": b"k\n", "a": "x/.."})
    assert b.result is not None
    snapshot_result(b.run, b.result, ours, base)
    assert _finalize(b).status == "held"
    assert ExecutionWorkspace.objects.get(pk=b.workspace.pk).head_tree == theirs
    hold = IssueRecoveryAction.objects.get(cause="workspace_head_conflict")
    assert hold.evidence["conflictingPaths"] == ["a"]


def test_a_workspace_created_over_a_directory_with_files_starts_from_them(
    tmp_path: Path, make_board_client: Any, make_agent_client: Any
) -> None:
    b = make_binding()
    cwd = tmp_path / "repo"
    (cwd / "src").mkdir(parents=True)
    (cwd / "src" / "app.py").write_text("print('app')\n")
    board = make_board_client(b.company)
    created = board.post(
        f"/api/companies/{b.company.pk}/execution-workspaces",
        {"name": "repo", "cwd": str(cwd)},
        format="json",
    )
    assert created.status_code == 201, created.content
    workspace_id = created.json()["id"]
    run_jobs()  # the creation deferred the adoption: the worker sees the cwd
    head = make_agent_client(b.agent).get(f"/api/execution-workspaces/{workspace_id}/head")
    tree = head.json()["tree"]
    assert tree is not None
    workspace = ExecutionWorkspace.objects.get(pk=workspace_id)
    assert workspace.cwd_tree == tree  # the cwd already holds it: nothing to materialize
    assert build(read_tree(str(cwd)))[0] == tree
    assert audit_count("workspace.head_adopted") == 1


@pytest.mark.parametrize("relative", [False, True])
def test_a_cwd_holding_a_link_out_of_it_is_not_adopted(tmp_path: Path, relative: bool) -> None:
    """Adoption reads the cwd without following links; one leaving it makes the cwd
    unadoptable (publishing waits for an operator) and nothing is stored or moved."""
    secret = tmp_path / "elsewhere"
    secret.mkdir()
    (secret / "secret.txt").write_text("not this workspace's\n")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "README.md").write_text("hello\n")
    (cwd / "leak").symlink_to("../elsewhere" if relative else secret)
    b = make_binding()
    b.workspace.cwd = str(cwd)
    b.workspace.save(update_fields=["cwd"])
    with pytest.raises(CwdUnadoptable):
        workspace_cwd_adopt(company_id=b.company.pk, workspace_id=b.workspace.pk)
    b.workspace.refresh_from_db()
    assert b.workspace.head_tree is None
    assert audit_count("workspace.head_adopted") == 0
