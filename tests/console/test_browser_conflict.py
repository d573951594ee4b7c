"""A workspace conflict walked in a real browser (Playwright driving the Debian chromium
package, see test_browser.py): the dashboard tile that counts the held run, the run's page
with its hold, the resolve page's preview of each resolution against the current head, the
choice, and the workspace's head afterwards, which keeps the work of the runs that committed
after the hold. Screenshots `conflict-*.png` at 1366 px wide go to `.screenshots/`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from paperclip.models import ExecutionWorkspace
from recovery.services import run_finalize
from tests.console.test_browser import follow, log_in, operator, page, shot
from tests.recovery.conflicts import files_of, held_then_two_commits, live_hold

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

__all__ = ["page"]  # the browser fixture, shared with test_browser.py

HELD_TILES = (
    'a.console-tile[data-kind="finalization_held"], '
    'a.console-tile[data-kind="finalization_retrying"]'
)


def test_resolve_a_workspace_conflict_from_the_dashboard_with_its_preview(
    page: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("recovery.admin.actions.RESOLVE_WAIT_SECONDS", 0.5)  # no worker here
    a, _tree = held_then_two_commits(tmp_path)
    hold = live_hold(a)
    operator(a.company, username="ops")
    page.set_viewport_size({"width": 1366, "height": 768})

    log_in(page, "ops")
    tile = page.locator(HELD_TILES).first
    assert tile.locator(".count").inner_text() == "1"
    shot(page, "conflict-dashboard")
    follow(page, tile)
    assert page.locator("#result_list tbody tr").count() == 1

    page.goto(f"{page.base_url}/admin/paperclip/heartbeatrun/{a.run.pk}/change/")
    panel = page.locator("#board-hold")
    assert panel.get_attribute("data-cause") == "workspace_head_conflict"
    assert panel.get_attribute("data-hold") == str(hold.pk)
    assert "keep_head" in panel.inner_text()  # the hold's next action names the choices
    shot(page, "conflict-run")

    follow(page, 'button[data-console-action="resolve_workspace_conflict"]')
    page.wait_for_selector("#outcome-publish")
    head_before = ExecutionWorkspace.objects.get(pk=a.workspace.pk).head_tree
    assert f"Current head {head_before}" in page.locator(f"#preview-{hold.pk}").inner_text()
    publish = page.locator("#outcome-publish").inner_text()
    keep = page.locator("#outcome-keep_head").inner_text()
    assert "Modified (1)" in publish
    assert "README.md" in publish
    assert "a.txt" in publish
    assert "README.md" not in keep
    assert "b.txt" not in publish + keep  # later runs' work: never removed by a resolution
    previewed = publish.split("New head")[1].strip()
    shot(page, "conflict-preview")

    page.check("input[name=resolution][value=publish]")
    page.fill("#id_note", "README: the reviewer approved the held run's version")
    follow(page, "input[name=apply]")
    message = page.locator("ul.messagelist").inner_text()
    assert "Resolved 1 (publish) against the head you previewed" in message
    assert "Refused: none" in message
    shot(page, "conflict-resolved")

    # The attempt the worker makes (Playwright's event loop rules out a worker in this thread).
    run_finalize(company_id=a.company.pk, run_id=a.run.pk)
    head = ExecutionWorkspace.objects.get(pk=a.workspace.pk).head_tree
    assert head == previewed  # the tree the preview named
    assert files_of(a, head) == {
        "README.md": b"A's README\n",
        "a.txt": b"a\n",
        "b.txt": b"b\n",
        "c.txt": b"c\n",
        "notes/guide.md": b"guide\n",
    }
    page.goto(f"{page.base_url}/admin/paperclip/executionworkspace/{a.workspace.pk}/change/")
    assert str(head) in page.locator("#content").inner_text()
    shot(page, "conflict-head-after")
    page.goto(f"{page.base_url}/admin/paperclip/heartbeatrun/{a.run.pk}/change/")
    assert page.locator("#board-hold").count() == 0
    shot(page, "conflict-run-after")
