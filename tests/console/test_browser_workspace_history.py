"""In a real browser (as tests/console/test_browser.py), 1366 px wide: an operator opens a
workspace's history, a move's diff with a text file side by side, the file browser at that
move, then restores an earlier version through its confirmation page (screenshots in the
test's tmp dir, `history-*.png`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from django.db import transaction

from paperclip.models import ExecutionWorkspace
from paperclip.snapshots.history import head_move_record_in_tx
from paperclip.snapshots.models import WorkspaceHeadMove
from tests.console.test_browser import (  # noqa: F401 - `page` is the browser fixture
    follow,
    log_in,
    operator,
    page,
)
from tests.paperclip.factories import CompanyFactory, ExecutionWorkspaceFactory
from tests.recovery.snapshots import store_tree

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

NOTE = "the second run broke the build; back to the first version"


def test_history_diff_files_and_restore(page: Any, tmp_path: Path) -> None:  # noqa: F811
    company = CompanyFactory(name="Acme Robotics")
    workspace = ExecutionWorkspaceFactory(company=company, name="acme-main")
    versions = [
        {"README.md": b"# Acme\nfirst line\nsecond\n", "src/main.py": b"print('hi')\n"},
        {"README.md": b"# Acme\nfirst line\nchanged\n", "src/main.py": b"print('hi')\n"},
    ]
    trees: list[str] = []
    for files in versions:
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
            )
        trees.append(tree)
    operator(company, username="ops")

    def shot(name: str) -> None:
        page.screenshot(path=str(tmp_path / f"history-{name}.png"), full_page=True)

    page.set_viewport_size({"width": 1366, "height": 768})
    log_in(page, "ops")
    page.goto(f"{page.base_url}/admin/paperclip/executionworkspace/{workspace.pk}/change/")
    history = page.locator("#history-moves").inner_text()
    assert history.index("2 (head)") < history.index("publish")
    shot("workspace")

    follow(page, '#history-moves tr[data-seq="2"] a:text("diff")')
    assert "README.md" in page.locator("table.workspace-changes").inner_text()
    follow(page, 'table.workspace-changes a:text("README.md")')
    assert "changed" in page.locator("table.diff").inner_text()
    shot("diff")

    page.go_back()
    follow(page, 'a:text("Browse the files at this move")')
    follow(page, '#file-list a:text("src/")')
    follow(page, '#file-list a:text("main.py")')
    assert "print('hi')" in page.locator("#file-text").inner_text()
    shot("files")

    page.goto(f"{page.base_url}/admin/paperclip/executionworkspace/{workspace.pk}/change/")
    follow(page, '#history-moves tr[data-seq="1"] a:text("Restore this version")')
    assert "README.md" in page.locator("table.workspace-changes").inner_text()
    page.fill("#id_note", NOTE)
    shot("restore-confirm")
    follow(page, "#restore-submit")
    assert "Restored: the head is now" in page.locator("ul.messagelist").inner_text()
    assert ExecutionWorkspace.objects.get(pk=workspace.pk).head_tree == trees[0]
    assert WorkspaceHeadMove.objects.get(workspace_id=workspace.pk, seq=3).kind == "restore"
    shot("restored")
    assert page.evaluate("document.documentElement.scrollWidth") <= 1366
