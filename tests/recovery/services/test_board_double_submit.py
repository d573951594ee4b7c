"""A duplicate of the board's owner-stop confirmation or export retry (a double click, a
client's retry) submitted while the first is still in its transaction waits for it and answers
as its replay: the same answer, nothing written, never `workspace_copyback_active` because the
first one's queued finalization may hold the run's finalization key by then."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
from django.db import connection
from django.test import override_settings

from paperclip.access import board_actor
from paperclip.models import ActivityEvent, BoardMembership, HeartbeatRun
from paperclip.receipts import OWNER_KEY
from recovery.services import recovery_owner_stop_confirm
from recovery.services.export_repair import workspace_export_retry
from tests.helpers import raw_connection, wait_for_lock_waiters
from tests.paperclip.factories import UserFactory
from tests.recovery.factories import Binding, hold_for_board, make_binding, receipt_for
from tests.recovery.services.test_export_repair import NOTE, _blocked, _exhaust, _repair

pytestmark = pytest.mark.django_db(transaction=True)

EVIDENCE = "k8s: pod finalizer-7f9 terminated 12:03Z, no copy processes left on node"


@pytest.fixture
def one_attempt() -> Iterator[None]:
    with override_settings(PAPERCLIP_FINALIZE_MAX_ATTEMPTS=1):
        yield


def _board_actor(b: Binding) -> Any:
    user = UserFactory()
    BoardMembership.objects.create(user=user, company=b.company)
    return board_actor(user)


def _overlapping(submit: Callable[[], Any], issue_id: UUID) -> tuple[Any, Any]:
    """Two submissions of the same request, the second made while the first is inside its
    transaction: the first waits on the issue row, held here, until the second is seen waiting
    too (or has already answered). Returns each one's answer or exception."""
    answers: dict[str, Any] = {}

    def attempt(name: str) -> None:
        try:
            answers[name] = submit()
        except Exception as exc:  # the assertions below report it
            answers[name] = exc
        finally:
            connection.close()

    with raw_connection(autocommit=False) as holder:
        holder.execute("SELECT 1 FROM issues WHERE id = %s FOR UPDATE", [issue_id])
        first = threading.Thread(target=attempt, args=("first",))
        first.start()
        wait_for_lock_waiters(1, holder=holder, table="issues")
        second = threading.Thread(target=attempt, args=("second",))
        second.start()
        wait_for_lock_waiters(2, until=lambda: "second" in answers)
        holder.rollback()
    first.join(timeout=30)
    second.join(timeout=30)
    return answers["first"], answers["second"]


def test_a_duplicate_owner_stop_confirmation_answers_as_the_first_one() -> None:
    receipt = receipt_for(hostname="gone.example")
    b = make_binding(receipt=receipt, phase="workspace_finalizing")
    hold = hold_for_board(b, receipt)
    actor = _board_actor(b)

    def submit() -> Any:
        return recovery_owner_stop_confirm(
            actor=actor,
            issue_id=b.issue.pk,
            action_id=hold.pk,
            run_id=b.run.pk,
            owner_token=receipt["token"],
            stop_evidence=EVIDENCE,
            controller_and_copyback_stopped=True,
        )

    first, second = _overlapping(submit, b.issue.pk)

    assert not isinstance(first, Exception), first
    assert not isinstance(second, Exception), f"{getattr(second, 'code', '')}: {second}"
    assert (first.replayed, second.replayed) == (False, True)
    assert (second.run_id, second.result_id, second.status) == (
        first.run_id,
        first.result_id,
        "queued",
    )
    assert OWNER_KEY not in HeartbeatRun.objects.get(pk=b.run.pk).runner_profile_json
    assert ActivityEvent.objects.filter(action="issue.workspace_owner_stop_confirmed").count() == 1


@pytest.mark.usefixtures("one_attempt")
def test_a_duplicate_export_retry_answers_as_the_first_one(tmp_path: Path) -> None:
    b = _blocked(tmp_path)
    hold = _exhaust(b)
    _repair(b)
    actor = _board_actor(b)

    def submit() -> Any:
        return workspace_export_retry(
            actor=actor,
            issue_id=b.issue.pk,
            action_id=hold.pk,
            run_id=b.run.pk,
            repair_note=NOTE,
        )

    first, second = _overlapping(submit, b.issue.pk)

    assert not isinstance(first, Exception), first
    assert not isinstance(second, Exception), f"{getattr(second, 'code', '')}: {second}"
    assert (first.replayed, second.replayed) == (False, True)
    assert (second.run_id, second.result_id, second.lease_id) == (
        first.run_id,
        first.result_id,
        first.lease_id,
    )
    retries = ActivityEvent.objects.filter(action="issue.workspace_export_retry_requested")
    assert retries.count() == 1
