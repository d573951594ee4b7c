"""recovery_action_upsert_source_scoped / resolve: docs/recovery.md#recovery-actions."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connection

from paperclip.models import ActivityEvent
from recovery.errors import RecoveryHoldNotDismissable
from recovery.locks import recovery_source_key
from recovery.models import IssueRecoveryAction
from recovery.selectors.actions import OWNER_UNVERIFIED_CAUSE
from recovery.services import (
    RecoveryActionInput,
    recovery_action_get_live,
    recovery_action_resolve,
    recovery_action_upsert_source_scoped,
)
from tests.helpers import raw_connection, wait_for_lock_waiters
from tests.paperclip.factories import IssueFactory


def _data(**kw: object) -> RecoveryActionInput:
    base: dict[str, object] = {
        "kind": "active_run_watchdog",
        "cause": "c1",
        "fingerprint": "f1",
        "evidence": {"runId": "r"},
        "next_action": "look",
    }
    base.update(kw)
    return RecoveryActionInput(**base)  # type: ignore[arg-type]


@pytest.mark.django_db
def test_insert_then_update_counts_attempts() -> None:
    issue = IssueFactory()
    first = recovery_action_upsert_source_scoped(
        company_id=issue.company_id, source_issue_id=issue.pk, data=_data(max_attempts=3)
    )
    assert (first.outcome, first.action.attempt_count, first.action.owner_type) == (
        "created",
        1,
        "board",
    )
    second = recovery_action_upsert_source_scoped(
        company_id=issue.company_id, source_issue_id=issue.pk, data=_data(max_attempts=3)
    )
    assert (second.outcome, second.action.attempt_count) == ("updated", 2)
    assert recovery_action_get_live(company_id=issue.company_id, issue_id=issue.pk) == second.action


@pytest.mark.django_db
def test_budget_exhaustion_escalates_to_the_board_then_is_idempotent() -> None:
    issue = IssueFactory()
    args = {"company_id": issue.company_id, "source_issue_id": issue.pk}
    recovery_action_upsert_source_scoped(**args, data=_data(max_attempts=1, wake_policy={"k": 1}))
    escalated = recovery_action_upsert_source_scoped(**args, data=_data(max_attempts=1))
    action = escalated.action
    assert escalated.outcome == "escalated"
    assert (action.status, action.owner_type, action.wake_policy, action.outcome) == (
        "escalated",
        "board",
        None,
        "escalated",
    )
    budget = action.evidence["recoveryBudget"]
    assert budget["state"] == "exhausted"
    assert (budget["attemptsUsed"], budget["maxAttempts"], budget["cause"]) == (1, 1, "c1")
    again = recovery_action_upsert_source_scoped(**args, data=_data(max_attempts=1))
    assert again.outcome == "unchanged"
    assert again.action.pk == action.pk


@pytest.mark.django_db
def test_identity_change_supersedes_when_asked() -> None:
    issue = IssueFactory()
    args = {"company_id": issue.company_id, "source_issue_id": issue.pk}
    old = recovery_action_upsert_source_scoped(**args, data=_data()).action
    new = recovery_action_upsert_source_scoped(
        **args, data=_data(fingerprint="f2", supersede_on_identity_change=True)
    )
    assert new.outcome == "superseded"
    old.refresh_from_db()
    assert (old.status, old.outcome) == ("cancelled", "cancelled")
    assert new.action.status == "active"
    assert new.action.fingerprint == "f2"


@pytest.mark.django_db(transaction=True)
def test_concurrent_upserts_leave_one_live_action() -> None:
    """Six upserts at once, forced: a separate connection holds the issue's advisory key (the
    upsert's first lock), all six are seen queued for it, then it lets go. Exactly one
    creates; every other counts its attempt on that same action."""
    issue = IssueFactory()

    def attempt(i: int) -> str:
        try:
            return recovery_action_upsert_source_scoped(
                company_id=issue.company_id,
                source_issue_id=issue.pk,
                data=_data(max_attempts=100),
            ).outcome
        finally:
            connection.close()

    key = recovery_source_key(issue.company_id, issue.pk)
    with raw_connection() as gate:
        gate.execute("SELECT pg_advisory_lock(hashtextextended(%s, 0))", [key])
        with ThreadPoolExecutor(max_workers=6) as pool:
            futures = [pool.submit(attempt, i) for i in range(6)]
            all_waiting = wait_for_lock_waiters(6, until=lambda: any(f.done() for f in futures))
            gate.execute("SELECT pg_advisory_unlock(hashtextextended(%s, 0))", [key])
            outcomes = sorted(f.result(timeout=30) for f in futures)
    assert all_waiting, f"an upsert went past the held advisory key: {outcomes}"
    assert outcomes == ["created"] + ["updated"] * 5
    live = IssueRecoveryAction.objects.get(source_issue=issue, status="active")
    assert live.attempt_count == 6
    assert ActivityEvent.objects.filter(entity_id=str(live.pk)).count() == 6
    assert IssueRecoveryAction.objects.filter(source_issue=issue).count() == 1


@pytest.mark.django_db
def test_generic_resolution_cannot_dismiss_an_owner_hold() -> None:
    issue = IssueFactory()
    args = {"company_id": issue.company_id, "source_issue_id": issue.pk}
    recovery_action_upsert_source_scoped(**args, data=_data(cause=OWNER_UNVERIFIED_CAUSE))
    with pytest.raises(RecoveryHoldNotDismissable):
        recovery_action_resolve(
            **args, outcome="false_positive", resolution_note="n", actor_type="user", actor_id="1"
        )
    other = IssueFactory(company=issue.company)
    recovery_action_upsert_source_scoped(
        company_id=issue.company_id, source_issue_id=other.pk, data=_data()
    )
    done = recovery_action_resolve(
        company_id=issue.company_id,
        source_issue_id=other.pk,
        outcome="restored",
        resolution_note="fixed",
        actor_type="user",
        actor_id="1",
    )
    assert (done.status, done.outcome) == ("resolved", "restored")
    assert done.resolved_at
