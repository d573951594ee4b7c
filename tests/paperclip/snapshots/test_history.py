"""A workspace's history, diff, files and restore through the API (docs/snapshots.md#history),
on a real database and store: the shapes of the contract, stable codes for bad input, the
board's rights, and another company's workspace looking absent."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection, transaction
from django.db.utils import DatabaseError
from rest_framework.test import APIClient

from paperclip.access import board_actor
from paperclip.errors import InvalidRequest
from paperclip.models import ActivityEvent, CasBlob, Company, ExecutionWorkspace
from paperclip.snapshots.diff import changes_between, tree_diff
from paperclip.snapshots.history import head_move_record_in_tx
from paperclip.snapshots.models import WorkspaceHeadMove
from paperclip.snapshots.restore import workspace_restore
from tests.helpers import assert_error
from tests.paperclip.factories import ExecutionWorkspaceFactory
from tests.recovery.snapshots import Files, entries_of, store_tree

pytestmark = pytest.mark.django_db

BASE: Files = {"README.md": b"hello\n", "src/main.py": b"print('hi')\n", "src/lib/a.py": b"a\n"}
NOTE = "the run broke the build; back to Monday's"


def _record(workspace: ExecutionWorkspace, tree: str, previous: str | None, **extra: Any) -> Any:
    with transaction.atomic():
        ExecutionWorkspace.objects.filter(pk=workspace.pk).update(head_tree=tree)
        return head_move_record_in_tx(
            company_id=workspace.company_id,
            workspace_id=workspace.pk,
            tree=tree,
            previous_tree=previous,
            kind=extra.pop("kind", "publish"),
            actor_type="system",
            actor_id="test",
            **extra,
        )


def _history_of(company: Company, *trees: Files) -> tuple[ExecutionWorkspace, list[str]]:
    workspace = ExecutionWorkspaceFactory(company=company)
    names: list[str] = []
    for files in trees:
        names.append(store_tree(company.pk, files))
        _record(workspace, names[-1], names[-2] if len(names) > 1 else None)
    return workspace, names


def test_every_move_is_listed_newest_first_page_by_page(
    company: Company, agent_client: APIClient, board_client: APIClient
) -> None:
    versions = [{**BASE, "n.txt": str(n).encode()} for n in range(5)]
    workspace, trees = _history_of(company, *versions)
    url = f"/api/execution-workspaces/{workspace.pk}/history"
    first = agent_client.get(url, {"limit": 2}).json()
    assert [m["seq"] for m in first["results"]] == [5, 4]
    assert first["next"] == 4
    second = board_client.get(url, {"limit": 2, "before": first["next"]}).json()
    assert [m["seq"] for m in second["results"]] == [3, 2]
    last = agent_client.get(url, {"before": 2}).json()
    assert [m["seq"] for m in last["results"]] == [1]
    assert last["next"] is None
    move = first["results"][0]
    assert move == {
        "seq": 5,
        "tree": trees[4],
        "previous_tree": trees[3],
        "kind": "publish",
        "run_id": None,
        "action_id": None,
        "actor": {"type": "system", "id": "test"},
        "at": move["at"],
        "note": None,
        "counts": {"added": 0, "removed": 0, "modified": 1},
    }
    # The first move counts everything as added: 3 files and 2 directories.
    assert last["results"][0]["counts"] == {"added": 6, "removed": 0, "modified": 0}


@pytest.mark.parametrize(
    "query",
    [
        {"limit": "0"},
        {"limit": "501"},
        {"limit": "x"},
        {"before": "-1"},
        {"limit": "1.5"},
        {"before": "9" * 5000},  # more digits than Python converts: was a 500
        {"limit": "9" * 5000},
        {"before": "²"},  # a digit to str.isdigit, not to int()
    ],
)
def test_a_bad_page_is_400(company: Company, agent_client: APIClient, query: Any) -> None:
    workspace, _ = _history_of(company, BASE)
    response = agent_client.get(f"/api/execution-workspaces/{workspace.pk}/history", query)
    assert_error(response, 400, "invalid_request")


def test_another_companys_workspace_is_404_everywhere(
    company: Company, other_company: Company, make_board_client: Callable[..., APIClient]
) -> None:
    workspace, trees = _history_of(other_company, BASE)
    board = make_board_client(company)
    base = f"/api/execution-workspaces/{workspace.pk}"
    assert_error(board.get(f"{base}/history"), 404, "not_found")
    assert_error(board.get(f"{base}/diff", {"from": "empty", "to": trees[0]}), 404, "not_found")
    assert_error(board.get(f"{base}/files", {"tree": trees[0]}), 404, "not_found")
    body = {"tree": trees[0], "expected_head": trees[0], "note": NOTE}
    assert_error(board.post(f"{base}/restore", body, format="json"), 404, "not_found")


def test_moves_recorded_in_another_company_are_never_listed(
    company: Company, other_company: Company, make_board_client: Callable[..., APIClient]
) -> None:
    """Were a workspace ever to change company (the console refuses it; a hand-made data
    fix), the moves recorded while it was the other's stay the other's."""
    workspace, _ = _history_of(other_company, BASE)
    ExecutionWorkspace.objects.filter(pk=workspace.pk).update(company=company)
    answer = make_board_client(company).get(f"/api/execution-workspaces/{workspace.pk}/history")
    assert answer.status_code == 200, answer.content
    assert answer.json()["results"] == []


def test_the_diff_walks_only_what_differs_and_equals_the_whole_trees_diff(
    company: Company, agent_client: APIClient
) -> None:
    rng = random.Random(40)
    before: Files = {
        f"d{d}/s{s}/f{f}.txt": f"{d}{s}{f}".encode()
        for d in range(6)
        for s in range(5)
        for f in range(8)
    }
    after: Files = dict(before)
    near = sorted(p for p in before if p.startswith(("d0/", "d1/")))  # 2 of 6 directories
    for path in rng.sample(near, 12):
        after[path] = b"changed " + path.encode()
    for path in rng.sample(near, 5):
        after.pop(path, None)
    after["new/deep/file.txt"] = b"new"
    after["d0/s0/f0.txt/inside"] = b"was a file"  # a file turned into a directory
    after.pop("d0/s0/f0.txt")
    old, new = store_tree(company.pk, before), store_tree(company.pk, after)
    diff = tree_diff(company_id=company.pk, before=old, after=new)
    whole = changes_between(entries_of(company.pk, before), entries_of(company.pk, after))
    assert [c.as_json() for c in diff.changes] == [c.as_json() for c in whole]
    assert diff.read < 32  # of 2 x 37 directories
    workspace = ExecutionWorkspaceFactory(company=company)
    url = f"/api/execution-workspaces/{workspace.pk}/diff"
    body = agent_client.get(url, {"from": old, "to": new, "limit": 3}).json()
    assert body["from"] == old
    assert body["to"] == new
    assert body["truncated"] is True
    assert body["changes"] == [c.as_json() for c in whole[:3]]
    everything = agent_client.get(url, {"from": "empty", "to": new}).json()
    assert everything["from"] == "empty"
    assert everything["truncated"] is False
    assert all(c["change"] == "added" and c["from"] is None for c in everything["changes"])


def test_a_tree_the_store_lacks_or_a_bad_name_is_refused(
    company: Company, agent_client: APIClient
) -> None:
    workspace, trees = _history_of(company, BASE)
    url = f"/api/execution-workspaces/{workspace.pk}/diff"
    absent = "sha256:" + "0" * 64
    error = assert_error(agent_client.get(url, {"from": "empty", "to": absent}), 404, "not_found")
    assert error["details"]["tree"] == absent
    for query in (
        {"from": "empty"},
        {"from": "HEAD", "to": trees[0]},
        {"from": "empty", "to": "sha256:xyz"},
        {"from": "empty", "to": trees[0], "limit": "10001"},
        {"from": "empty", "to": trees[0], "limit": "9" * 5000},
    ):
        assert_error(agent_client.get(url, query), 400, "invalid_request")


def test_the_board_browses_a_recorded_tree(
    company: Company, board_client: APIClient, agent_client: APIClient
) -> None:
    workspace, trees = _history_of(company, {**BASE, "link": "src/main.py"})
    url = f"/api/execution-workspaces/{workspace.pk}/files"
    root = board_client.get(url, {"tree": trees[0]}).json()
    assert root["type"] == "dir"
    assert root["path"] == ""
    assert [e["name"] for e in root["entries"]] == ["README.md", "link", "src"]
    lib = board_client.get(url, {"tree": trees[0], "path": "/src/lib/"}).json()
    assert [(e["name"], e["type"]) for e in lib["entries"]] == [("a.py", "file")]
    file = board_client.get(url, {"tree": trees[0], "path": "src/main.py"})
    assert file["Content-Type"] == "application/octet-stream"
    assert b"".join(file.streaming_content) == b"print('hi')\n"
    link = board_client.get(url, {"tree": trees[0], "path": "link"}).json()
    assert link == {"tree": trees[0], "path": "link", "type": "symlink", "target": "src/main.py"}
    assert_error(board_client.get(url, {"tree": trees[0], "path": "nope"}), 404, "not_found")
    assert_error(board_client.get(url, {"tree": trees[0], "path": "README.md/x"}), 404, "not_found")
    assert_error(board_client.get(url, {"tree": trees[0], "path": "README.md/"}), 404, "not_found")
    for bad in ("//", "//src", "src//lib"):
        assert_error(board_client.get(url, {"tree": trees[0], "path": bad}), 400, "invalid_request")
    assert_error(
        board_client.get(url, {"tree": trees[0], "path": "../etc"}), 400, "invalid_request"
    )
    assert_error(board_client.get(url, {}), 400, "invalid_request")
    unrecorded = store_tree(company.pk, {"other": b"x"})
    assert_error(board_client.get(url, {"tree": unrecorded}), 404, "not_found")
    assert_error(agent_client.get(url, {"tree": trees[0]}), 403, "permission_denied")


def test_a_file_over_the_blob_limit_is_refused(
    company: Company, board_client: APIClient, settings: Any
) -> None:
    workspace, trees = _history_of(company, BASE)
    settings.PAPERCLIP_CAS_MAX_BLOB_BYTES = 4
    url = f"/api/execution-workspaces/{workspace.pk}/files"
    response = board_client.get(url, {"tree": trees[0], "path": "README.md"})
    assert assert_error(response, 422, "file_too_large")["details"]["max_bytes"] == 4


def test_the_board_restores_a_recorded_tree_by_compare_and_set(
    company: Company, board_client: APIClient, agent_client: APIClient
) -> None:
    workspace, trees = _history_of(company, BASE, {**BASE, "broken.txt": b"oops"})
    url = f"/api/execution-workspaces/{workspace.pk}/restore"
    body = {"tree": trees[0], "expected_head": trees[1], "note": NOTE}
    assert_error(agent_client.post(url, body, format="json"), 403, "permission_denied")
    moved = board_client.post(url, {**body, "expected_head": trees[0]}, format="json")
    assert assert_error(moved, 409, "workspace_head_moved")["details"]["head"] == trees[1]
    short = board_client.post(url, {**body, "note": "too short"}, format="json")
    assert_error(short, 400, "invalid_request")
    stranger = store_tree(company.pk, {"x": b"y"})
    alien = board_client.post(url, {**body, "tree": stranger}, format="json")
    assert_error(alien, 400, "invalid_request")
    extra = board_client.post(url, {**body, "force": True}, format="json")
    assert_error(extra, 400, "invalid_request")
    assert ExecutionWorkspace.objects.get(pk=workspace.pk).head_tree == trees[1]

    response = board_client.post(url, body, format="json")

    assert response.status_code == 200, response.content
    move = response.json()
    assert move["kind"] == "restore"
    assert move["seq"] == 3
    assert (move["tree"], move["previous_tree"]) == (trees[0], trees[1])
    assert move["actor"] == {"type": "board", "id": str(board_client.user.pk)}  # type: ignore[attr-defined]
    assert move["note"] == NOTE
    assert move["counts"] == {"added": 0, "removed": 1, "modified": 0}
    workspace.refresh_from_db()
    assert workspace.head_tree == trees[0]
    assert workspace.head_run_id is None
    audit = ActivityEvent.objects.get(action="workspace.head_restored")
    assert audit.details["seq"] == 3
    # The same request again (its answer lost): its move, and nothing written.
    again = board_client.post(url, body, format="json")
    assert (again.status_code, again.json()) == (200, move)
    assert ActivityEvent.objects.filter(action="workspace.head_restored").count() == 1
    assert WorkspaceHeadMove.objects.filter(workspace_id=workspace.pk).count() == 3
    # Another note is another request: the head is no longer the one it expected.
    other = {**body, "note": NOTE + " (again)"}
    assert_error(board_client.post(url, other, format="json"), 409, "workspace_head_moved")
    same = {"tree": trees[0], "expected_head": trees[0], "note": NOTE}
    assert_error(board_client.post(url, same, format="json"), 400, "invalid_request")


@pytest.mark.parametrize("note", [NOTE + "\0", NOTE + "x" * 4000])
def test_a_restore_note_with_nul_or_too_long_is_400(
    company: Company, board_client: APIClient, note: str
) -> None:
    """Checked by the service, for the console's form too (NUL was a 500 from PostgreSQL)."""
    workspace, trees = _history_of(company, BASE, {**BASE, "broken.txt": b"oops"})
    url = f"/api/execution-workspaces/{workspace.pk}/restore"
    body = {"tree": trees[0], "expected_head": trees[1], "note": note}
    assert_error(board_client.post(url, body, format="json"), 400, "invalid_request")
    with pytest.raises(InvalidRequest):
        workspace_restore(
            actor=board_actor(board_client.user),  # type: ignore[attr-defined]
            workspace_id=workspace.pk,
            tree=trees[0],
            expected_head=trees[1],
            note=note,
        )
    assert ExecutionWorkspace.objects.get(pk=workspace.pk).head_tree == trees[1]


def test_a_collected_tree_is_404_even_when_its_directories_are_cached(
    company: Company, board_client: APIClient
) -> None:
    """The diff and the files ask the rows whether the company still holds the tree: the
    process's cache of directory blobs answered 200 for a collected tree, and a tree
    compared with itself was never looked up at all."""
    workspace, trees = _history_of(company, BASE)
    base = f"/api/execution-workspaces/{workspace.pk}"
    diff = {"from": "empty", "to": trees[0]}
    assert board_client.get(f"{base}/diff", diff).status_code == 200  # fills the cache
    assert board_client.get(f"{base}/files", {"tree": trees[0]}).status_code == 200
    CasBlob.objects.filter(company_id=company.pk).delete()  # as collection does
    assert_error(board_client.get(f"{base}/diff", diff), 404, "not_found")
    assert_error(board_client.get(f"{base}/files", {"tree": trees[0]}), 404, "not_found")
    absent = "sha256:" + "0" * 64
    same = {"from": absent, "to": absent}
    assert_error(board_client.get(f"{base}/diff", same), 404, "not_found")


def test_moves_are_never_rewritten(company: Company) -> None:
    workspace, _ = _history_of(company, BASE)
    # Bad input for the guard: an UPDATE of a recorded move. The trigger refuses it.
    with pytest.raises(DatabaseError, match="never rewritten"), transaction.atomic():
        WorkspaceHeadMove.objects.filter(workspace=workspace).update(note="rewritten")
    assert WorkspaceHeadMove.objects.get(workspace=workspace).note is None


def test_the_migration_records_todays_heads_as_first_moves(company: Company) -> None:
    from importlib import import_module

    migration = import_module("paperclip.migrations.0011_workspace_head_moves")
    tree = store_tree(company.pk, BASE)
    with_head = ExecutionWorkspaceFactory(company=company, head_tree=tree)
    ExecutionWorkspaceFactory(company=company)  # no head: no move
    with connection.cursor() as cursor:
        cursor.execute(migration.FIRST_MOVES)
    move = WorkspaceHeadMove.objects.get(company=company)
    assert (move.workspace_id, move.seq, move.tree, move.kind) == (
        with_head.pk,
        1,
        tree,
        "adoption",
    )
    assert (move.actor_type, move.actor_id) == ("system", "migration")
