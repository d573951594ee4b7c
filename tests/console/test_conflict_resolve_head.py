"""The console's conflict resolution decides against the head its page previewed: a post
without that head (a page whose preview failed, a form cut short or tampered with) may only
discard the run's tree; publishing or keeping the head is refused and changes nothing, so a
run that committed after the preview keeps its work."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.test import Client

from paperclip.models import ActivityEvent
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


def _confirm(client: Client, hold_pk: object, resolution: str) -> str:
    page = client.post(
        ACTIONS,
        {
            "action": "resolve_workspace_conflict",
            "_selected_action": [str(hold_pk)],
            "apply": "1",
            "resolution": resolution,
            "note": "approved by the reviewer",
        },
        follow=True,
    )
    assert page.status_code == 200
    return page.content.decode()


@pytest.mark.parametrize("resolution", ["publish", "keep_head"])
def test_a_decision_without_the_previewed_head_is_refused(
    tmp_path: Path, superuser_client: Client, resolution: str
) -> None:
    a, _tree = held_then_two_commits(tmp_path)
    hold = live_hold(a)
    preview = {"action": "resolve_workspace_conflict", "_selected_action": [str(hold.pk)]}
    assert superuser_client.post(ACTIONS, preview).status_code == 200
    seen = head_of(a)
    # After the preview another run commits its own README over the head the board saw.
    y = in_workspace(a, {**files_of(a, seen), "README.md": b"Y's README\n"}, base=seen)
    assert finalize(y).status == "committed"
    run_jobs()  # whatever that commit queued
    writes = ActivityEvent.objects.count()
    said = _confirm(superuser_client, hold.pk, resolution)  # no expected_head_<pk> posted
    assert "No previewed head was posted" in said
    assert ActivityEvent.objects.count() == writes  # the refusal wrote nothing
    run_jobs()
    assert files_of(a, head_of(a))["README.md"] == b"Y's README\n"


def test_discarding_needs_no_preview(tmp_path: Path, superuser_client: Client) -> None:
    a, _tree = held_then_two_commits(tmp_path)
    hold = live_hold(a)
    head = head_of(a)
    said = _confirm(superuser_client, hold.pk, "discard")
    assert "Resolved 1 (discard)" in said
    run_jobs()
    assert head_of(a) == head
