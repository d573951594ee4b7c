"""manage.py expire_runner_authorities."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from checkpoints.services import checkpoint_write
from paperclip.models import ActivityEvent, NativeRunFinalization
from tests.checkpoints.factories import coordinator, expire_lease, lease, owner_of

pytestmark = pytest.mark.django_db


def _with_checkpoint(*, expired: bool) -> NativeRunFinalization:
    fin = coordinator()
    checkpoint_write(
        run_id=fin.run_id,
        agent_id=fin.run.agent_id,
        owner=owner_of(lease(fin.run)),
        reset=False,
        changed={"header": "h"},
        removed=[],
        work_command_ids=[],
        predecessor=None,
    )
    if expired:
        expire_lease(fin.run_id)
    return fin


def test_dry_run_lists_and_changes_nothing() -> None:
    due = _with_checkpoint(expired=True)
    _with_checkpoint(expired=False)
    out = StringIO()
    call_command("expire_runner_authorities", "--dry-run", stdout=out)
    assert f"would expire {due.run_id}" in out.getvalue()
    assert "1 expired authorities, nothing changed" in out.getvalue()
    due.refresh_from_db()
    assert due.lease_owner is not None
    assert not ActivityEvent.objects.filter(action="controller_lease.expired").exists()


def test_expires_due_runs_in_batches_then_is_idempotent() -> None:
    due = sorted([_with_checkpoint(expired=True) for _ in range(3)], key=lambda f: f.run_id)
    live = _with_checkpoint(expired=False)
    out = StringIO()
    call_command("expire_runner_authorities", "--batch-size", "2", stdout=out)
    text = out.getvalue()
    assert "batch 2:" in text
    assert "done: 3 found, 3 expired, 0 skipped" in text
    for fin in due:
        fin.refresh_from_db()
        assert fin.lease_owner is None
        assert fin.lease_expires_at is not None
    live.refresh_from_db()
    assert live.lease_owner is not None
    assert ActivityEvent.objects.filter(action="controller_lease.expired").count() == 3
    # The old owner is fenced off for good; a new controller takes over (audited as such).
    grant = lease(due[0].run, boot_id="boot-b")
    assert (grant.outcome, grant.generation) == ("taken_over", 2)
    event = ActivityEvent.objects.get(run=due[0].run, action="controller_lease.taken_over")
    assert (event.details["previousBootId"], event.details["previousGeneration"]) == ("boot-a", 1)
    again = StringIO()
    call_command("expire_runner_authorities", stdout=again)
    assert "0 expired" in again.getvalue()
    assert ActivityEvent.objects.filter(action="controller_lease.expired").count() == 3


def test_bad_batch_size() -> None:
    with pytest.raises(CommandError):
        call_command("expire_runner_authorities", "--batch-size", "0", stdout=StringIO())
