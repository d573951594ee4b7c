"""The console's "Resolve workspace conflict…": the page previews, per resolution, the paths
added, removed and modified relative to the current head before the board confirms; it posts
the head it previewed, so a head that moved meanwhile is refused with a clear message and
nothing changes; the message after confirming says what the worker did
(docs/snapshots.md#conflicts)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from paperclip.models import ActivityEvent
from recovery.admin import actions as console_actions
from recovery.admin.conflict_preview import what_happened
from recovery.models import IssueRecoveryAction
from tests.helpers import run_jobs
from tests.recovery.conflicts import (
    files_of,
    finalize,
    head_of,
    held_then_two_commits,
    in_workspace,
    live_hold,
)

pytestmark = pytest.mark.django_db(transaction=True)

ACTIONS = "/admin/recovery/issuerecoveryaction/"


def _outcome(html: str, name: str) -> str:
    found = re.search(rf'id="outcome-{name}">(.*?)</div>', html, re.S)
    assert found is not None, name
    return found.group(1)


def _page(client: Client, hold: IssueRecoveryAction) -> str:
    page = client.post(
        ACTIONS, {"action": "resolve_workspace_conflict", "_selected_action": [str(hold.pk)]}
    )
    assert page.status_code == 200
    return page.content.decode()


def _confirm(client: Client, hold: IssueRecoveryAction, html: str, resolution: str) -> str:
    expected = re.search(rf'name="expected_head_{hold.pk}" value="([^"]+)"', html)
    assert expected is not None
    done = client.post(
        ACTIONS,
        {
            "action": "resolve_workspace_conflict",
            "_selected_action": [str(hold.pk)],
            f"expected_head_{hold.pk}": expected.group(1),
            "apply": "1",
            "resolution": resolution,
            "note": "the reviewer approved this run",
        },
        follow=True,
    )
    return done.content.decode()


def test_the_resolve_page_previews_each_resolution_against_the_current_head(
    tmp_path: Path, superuser_client: Client
) -> None:
    a, _tree = held_then_two_commits(tmp_path)
    hold = live_hold(a)
    writes = ActivityEvent.objects.count()
    html = _page(superuser_client, hold)
    assert ActivityEvent.objects.count() == writes
    assert str(head_of(a)) in html  # the head the preview is relative to
    publish, keep = _outcome(html, "publish"), _outcome(html, "keep_head")
    assert "Modified (1)" in publish
    assert "README.md" in publish
    assert "Added (1)" in publish
    assert "a.txt" in publish
    assert "Removed (2)" in publish
    assert "src/main.py" in publish
    assert "README.md" not in keep
    assert "a.txt" in keep
    # The work committed after the hold is in the head already: no resolution removes it.
    for outcome in (publish, keep):
        assert "b.txt" not in outcome
        assert "c.txt" not in outcome
    assert "replacing the head" not in live_hold(a).next_action


def test_a_head_that_moved_after_the_preview_is_refused_and_nothing_changes(
    tmp_path: Path, superuser_client: Client
) -> None:
    a, _tree = held_then_two_commits(tmp_path)
    hold = live_hold(a)
    html = _page(superuser_client, hold)
    seen = head_of(a)
    d = in_workspace(a, {**files_of(a, seen), "d.txt": b"d\n"}, base=seen)
    assert finalize(d).status == "committed"
    writes = ActivityEvent.objects.count()

    message = _confirm(superuser_client, hold, html, "publish")

    assert "workspace_head_moved" in message
    assert "moved since the preview" in message
    assert ActivityEvent.objects.count() == writes
    assert live_hold(a).status == "active"


def test_the_message_after_confirming_says_what_the_worker_did(
    tmp_path: Path, superuser_client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, _tree = held_then_two_commits(tmp_path)
    hold = live_hold(a)
    html = _page(superuser_client, hold)
    monkeypatch.setattr(console_actions, "RESOLVE_WAIT_SECONDS", 0.0)
    queued = _confirm(superuser_client, hold, html, "keep_head")
    assert "Resolved 1 (keep_head)" in queued
    assert "the worker has not finished yet" in queued  # no worker in this test
    run_jobs()
    assert files_of(a, head_of(a))["README.md"] == b"X's README\n"
    # Once the worker committed, the same words report it (the page's own helper).
    said = what_happened(hold, a.run.pk, None, 0.0)
    assert f"the workspace head is now {head_of(a)}" in said
    assert "keep_head" in said


def test_a_preview_that_cannot_be_read_is_shown_not_a_failed_page(
    tmp_path: Path, superuser_client: Client, monkeypatch: Any
) -> None:
    a, _tree = held_then_two_commits(tmp_path)
    hold = live_hold(a)
    hold.evidence = {**hold.evidence, "tree": "sha256:" + "0" * 64}
    hold.save(update_fields=["evidence"])
    html = _page(superuser_client, hold)
    assert "No preview: workspace_conflict_unreadable" in html
