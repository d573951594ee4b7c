"""The console's pages for a workspace's history (docs/snapshots.md#the-console): the history on
the workspace's page, a move's diff with a side-by-side view, the file browser, and "Restore
this version…" with its preview, its note, its compare-and-set and what it reports; unknown
moves, trees and paths are 404, another company's workspace too."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.db import transaction
from django.urls import reverse

from paperclip.models import Company, ExecutionWorkspace
from paperclip.snapshots.history import head_move_record_in_tx
from paperclip.snapshots.models import WorkspaceHeadMove
from tests.console.test_pages import staff
from tests.paperclip.factories import (
    AgentFactory,
    CompanyFactory,
    ExecutionWorkspaceFactory,
    HeartbeatRunFactory,
)
from tests.recovery.snapshots import Files, store_tree

pytestmark = pytest.mark.django_db

V1: Files = {"README.md": b"hello\nworld\n", "src/main.py": b"print('hi')\n", "img.bin": b"\0\1"}
V2: Files = {"README.md": b"hello\nthere\n", "src/main.py": b"print('hi')\n", "new.txt": b"n\n"}
NOTE = "the second run broke the build; back to the first"


def _history(company: Company) -> tuple[ExecutionWorkspace, list[str]]:
    workspace = ExecutionWorkspaceFactory(company=company)
    run = HeartbeatRunFactory(company=company, agent=AgentFactory(company=company, name="bob"))
    trees: list[str] = []
    for files in (V1, V2):
        tree = store_tree(company.pk, files)
        with transaction.atomic():
            ExecutionWorkspace.objects.filter(pk=workspace.pk).update(head_tree=tree)
            head_move_record_in_tx(
                company_id=company.pk,
                workspace_id=workspace.pk,
                tree=tree,
                previous_tree=trees[-1] if trees else None,
                kind="publish",
                actor_type="system",
                actor_id="test",
                run_id=run.pk if trees else None,
            )
        trees.append(tree)
    workspace.refresh_from_db()
    return workspace, trees


def _url(name: str, workspace: ExecutionWorkspace, *args: Any) -> str:
    return reverse(f"admin:paperclip_executionworkspace_{name}", args=[workspace.pk, *args])


def test_the_workspace_page_shows_head_cwd_state_and_history(company: Company) -> None:
    workspace, trees = _history(company)
    html = staff(company).get(_url("change", workspace)).content.decode()
    assert f"Head {trees[1]}" in html
    assert 'id="cwd-state"' in html
    assert "run of bob" in html  # the run that moved the head, by its agent's name
    assert 'data-seq="2"' in html
    assert 'data-seq="1"' in html
    assert html.index('data-seq="2"') < html.index('data-seq="1"')  # newest first
    assert _url("move_diff", workspace, 1) in html
    assert _url("move_restore", workspace, 1) in html
    assert _url("move_restore", workspace, 2) not in html  # the head: nothing to restore


def test_the_workspace_page_is_a_view_with_its_settings_folded_away(company: Company) -> None:
    workspace, _ = _history(company)
    html = staff(company).get(_url("change", workspace)).content.decode()
    history, state, settings = (
        html.index('data-seq="1"'),
        html.index(">State<"),
        html.index("Settings"),
    )
    assert history < state < settings  # the history, the state, then the settings
    # The editable settings sit in a folded <details> (Django's collapsed fieldset).
    assert html.rindex("<details", 0, settings) > state
    assert html.index('name="name"') > settings
    # Adding a workspace is still a plain form.
    add = staff(company).get(reverse("admin:paperclip_executionworkspace_add")).content.decode()
    assert "<details" not in add


def test_the_diff_lists_changes_and_shows_a_text_file_side_by_side(company: Company) -> None:
    workspace, _trees = _history(company)
    client = staff(company)
    html = client.get(_url("move_diff", workspace, 2)).content.decode()
    for path, kind in (("README.md", "modified"), ("new.txt", "added"), ("img.bin", "removed")):
        assert f'<tr class="change-{kind}">' in html
        assert path in html
    side = client.get(_url("move_diff", workspace, 2), {"path": "README.md"}).content.decode()
    assert 'class="diff"' in side
    assert "there" in side
    assert "world" in side
    first = client.get(_url("move_diff", workspace, 1), {"path": "img.bin"}).content.decode()
    assert "a binary file (2 bytes): not shown" in first


def test_the_file_browser_lists_directories_and_shows_files(company: Company) -> None:
    workspace, _trees = _history(company)
    client = staff(company)
    root = client.get(_url("move_files", workspace, 1)).content.decode()
    assert "src/" in root
    assert "img.bin" in root
    listing = client.get(_url("move_files", workspace, 1), {"path": "src"}).content.decode()
    assert "main.py" in listing
    text = client.get(_url("move_files", workspace, 1), {"path": "README.md"}).content.decode()
    assert "world" in text


@pytest.mark.parametrize(
    ("name", "seq", "query"),
    [
        ("move_diff", 9, {}),
        ("move_diff", 2, {"path": "nowhere.txt"}),
        ("move_files", 9, {}),
        ("move_files", 1, {"path": "nowhere/at/all"}),
        ("move_files", 1, {"path": "../etc"}),
        ("move_restore", 9, {}),
    ],
)
def test_unknown_moves_and_paths_are_404(
    company: Company, name: str, seq: int, query: dict[str, str]
) -> None:
    workspace, _trees = _history(company)
    assert staff(company).get(_url(name, workspace, seq), query).status_code == 404


def test_another_companys_workspace_is_404(company: Company) -> None:
    workspace, _trees = _history(company)
    other = staff(CompanyFactory())
    for name in ("move_diff", "move_files", "move_restore"):
        assert other.get(_url(name, workspace, 1)).status_code == 404
    assert other.post(_url("move_restore", workspace, 1), {"note": NOTE}).status_code == 404
    assert ExecutionWorkspace.objects.get(pk=workspace.pk).head_tree == workspace.head_tree


def test_restore_previews_requires_a_note_and_moves_the_head(company: Company) -> None:
    workspace, trees = _history(company)
    client = staff(company)
    url = _url("move_restore", workspace, 1)
    preview = client.get(url).content.decode()
    assert f'name="expected_head" value="{trees[1]}"' in preview
    assert "new.txt" in preview
    assert "img.bin" in preview
    short = client.post(url, {"note": "too short", "expected_head": trees[1]})
    assert short.status_code == 200
    assert "At least 20 characters" in short.content.decode()
    assert ExecutionWorkspace.objects.get(pk=workspace.pk).head_tree == trees[1]
    done = client.post(url, {"note": NOTE, "expected_head": trees[1]}, follow=True)
    assert f"Restored: the head is now {trees[0]} (move 3" in done.content.decode()
    assert ExecutionWorkspace.objects.get(pk=workspace.pk).head_tree == trees[0]
    move = WorkspaceHeadMove.objects.get(workspace_id=workspace.pk, seq=3)
    assert (move.kind, move.note) == ("restore", NOTE)
    # Move 1 holds the head's tree again, but only the newest move is the head.
    page = client.get(reverse("admin:paperclip_executionworkspace_change", args=[workspace.pk]))
    text = page.content.decode()
    assert text.count("(head)") == 1
    assert ">3 (head)<" in text
    assert _url("move_restore", workspace, 1) in text


def test_restore_when_the_head_moved_meanwhile_changes_nothing(company: Company) -> None:
    workspace, trees = _history(company)
    client = staff(company)
    stale = client.post(
        _url("move_restore", workspace, 1), {"note": NOTE, "expected_head": trees[0]}, follow=True
    )
    assert "Nothing changed: the head moved to" in stale.content.decode()
    assert ExecutionWorkspace.objects.get(pk=workspace.pk).head_tree == trees[1]
    assert not WorkspaceHeadMove.objects.filter(workspace_id=workspace.pk, seq=3).exists()


def test_bad_input_on_the_pages_is_an_answer_not_a_500(company: Company) -> None:
    workspace, trees = _history(company)
    client = staff(company)
    for before in ("²", "9" * 5000):
        assert client.get(_url("change", workspace), {"before": before}).status_code == 200
    nul = client.post(
        _url("move_restore", workspace, 1), {"note": NOTE + "\0", "expected_head": trees[1]}
    )
    assert nul.status_code == 200
    assert "no NUL" in nul.content.decode()
    assert ExecutionWorkspace.objects.get(pk=workspace.pk).head_tree == trees[1]


def test_the_pages_need_the_workspaces_permissions(company: Company) -> None:
    workspace, trees = _history(company)
    nobody = staff(company, perms=False)
    for name in ("move_diff", "move_files", "move_restore"):
        assert nobody.get(_url(name, workspace, 1)).status_code == 403
    viewer = staff(company, perms=False)
    user = viewer.session["_auth_user_id"]
    get_user_model().objects.get(pk=user).user_permissions.set(
        Permission.objects.filter(codename="view_executionworkspace")
    )
    assert viewer.get(_url("move_diff", workspace, 1)).status_code == 200
    page = viewer.post(
        _url("move_restore", workspace, 1), {"note": NOTE, "expected_head": trees[1]}
    )
    assert page.status_code == 403
    assert ExecutionWorkspace.objects.get(pk=workspace.pk).head_tree == trees[1]
