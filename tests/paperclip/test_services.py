"""Service-level behaviour other apps compose with."""

from __future__ import annotations

import pytest
from django.db import transaction

from paperclip.locks import run_lock_with_issue
from paperclip.models import ActivityEvent, Issue
from paperclip.services import absolute_path_error, run_finish_in_tx
from tests.paperclip.factories import HeartbeatRunFactory, IssueFactory

pytestmark = pytest.mark.django_db


def test_run_finish_locked_composes_inside_a_callers_transaction() -> None:
    issue = IssueFactory()
    run = HeartbeatRunFactory(company=issue.company, issue=issue, status="running")
    Issue.objects.filter(pk=issue.pk).update(execution_run=run, checkout_run=run)
    with transaction.atomic():
        locked = run_lock_with_issue(run_id=run.pk)
        run_finish_in_tx(
            run=locked.run,
            to_status="succeeded",
            actor_type="system",
            actor_id="finalizer",
            details={"via": "finalization"},
        )
    run.refresh_from_db()
    issue.refresh_from_db()
    assert run.status == "succeeded"
    assert run.finished_at is not None
    assert issue.execution_run_id is None
    assert issue.checkout_run_id is None
    event = ActivityEvent.objects.get(action="heartbeat_run.status_changed")
    assert event.details == {"via": "finalization", "from": "running", "to": "succeeded"}


def test_run_finish_locked_refuses_non_terminal_status() -> None:
    run = HeartbeatRunFactory(status="running")
    with transaction.atomic(), pytest.raises(ValueError, match="terminal"):
        run_finish_in_tx(run=run, to_status="queued", actor_type="system", actor_id="x")


@pytest.mark.django_db(transaction=True)
def test_run_finish_locked_needs_a_transaction() -> None:
    run = HeartbeatRunFactory(status="running")
    with pytest.raises(RuntimeError, match="transaction"):
        run_finish_in_tx(run=run, to_status="failed", actor_type="system", actor_id="x")
    run.refresh_from_db()
    assert run.status == "running"


@pytest.mark.parametrize(
    ("path", "ok"),
    [
        ("/srv/a", True),
        ("/", True),
        ("a/b", False),
        ("", False),
        ("/a/../b", False),
        ("/a\x00", False),
    ],
)
def test_absolute_path_rule(path: str, ok: bool) -> None:
    assert (absolute_path_error(path) is None) is ok
