"""The cleanup protocol's services called directly: the claim and back-off boundaries on a
pinned database clock, the termination receipt a settle stores, the audit rows, and the
retry sweep (`environment_cleanups_retry_due`) that reopens failed cleanups."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from django.db import connection

import leases.environment.services as services
from leases.environment.errors import CleanupInFlight, CleanupRetryNotDue
from leases.environment.services import (
    CLEANUP_CLAIM_TTL_MS,
    environment_cleanups_retry_due,
    environment_lease_cleanup_claim,
    environment_lease_cleanup_settle,
)
from leases.models import EnvironmentLease
from paperclip.db.clock import db_now
from paperclip.models import ActivityEvent, Company
from tests.helpers import raw_connection
from tests.leases.environment.factories import pending_cleanup_lease, set_meta

pytestmark = pytest.mark.django_db


@pytest.fixture
def now_ms(monkeypatch: pytest.MonkeyPatch) -> int:
    """The services' database clock, pinned (to a whole millisecond, the unit of the
    metadata's times): boundaries can then be hit exactly."""
    now = db_now()
    pinned = now.replace(microsecond=now.microsecond // 1000 * 1000)
    monkeypatch.setattr(services, "db_now", lambda: pinned)
    return int(pinned.timestamp() * 1000)


def _claim(lease: EnvironmentLease, **kw: Any) -> services.CleanupClaim:
    return environment_lease_cleanup_claim(
        lease_id=lease.pk, company_id=lease.company_id, actor_type="agent", actor_id="w-1", **kw
    )


def _settle(lease: EnvironmentLease, attempt: str, state: str) -> EnvironmentLease:
    return environment_lease_cleanup_settle(
        lease_id=lease.pk,
        company_id=lease.company_id,
        attempt_id=attempt,
        provider_lease_id=lease.provider_lease_id,
        state=state,  # type: ignore[arg-type]
        actor_type="agent",
        actor_id="w-2",
    )


def _audit(lease: EnvironmentLease, action: str) -> ActivityEvent:
    return ActivityEvent.objects.get(entity_id=str(lease.pk), action=action)


def _ms_iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat()


# --- the claim ------------------------------------------------------------------------------


def test_a_claim_answers_and_audits_its_attempt_expiry_actor_and_run(
    company: Company, now_ms: int
) -> None:
    lease = pending_cleanup_lease(company, intent=None)
    claim = _claim(lease, attempt_id="token-1")
    expires_ms = now_ms + CLEANUP_CLAIM_TTL_MS
    assert (claim.attempt_id, claim.stop_only) == ("token-1", False)
    assert claim.expires_at == datetime.fromtimestamp(expires_ms / 1000, tz=UTC)
    assert claim.lease.metadata["pendingCleanupLeaseExpiresAtMs"] == expires_ms
    audit = _audit(lease, "environment_lease.cleanup_claimed")
    assert (audit.company_id, audit.actor_type, audit.actor_id) == (company.pk, "agent", "w-1")
    assert (audit.entity_type, audit.run_id) == ("environment_lease", lease.heartbeat_run_id)
    assert audit.details == {
        "attemptId": "token-1",
        "previousAttemptId": None,
        "expiresAtMs": expires_ms,
        "reclaimedExpiredClaim": False,
    }


def test_a_claim_expiring_now_is_reclaimed_one_expiring_a_millisecond_later_is_in_flight(
    company: Company, now_ms: int
) -> None:
    lease = pending_cleanup_lease(company, intent=None)
    first = _claim(lease).attempt_id
    set_meta(EnvironmentLease.objects.get(pk=lease.pk), pendingCleanupLeaseExpiresAtMs=now_ms + 1)
    with pytest.raises(CleanupInFlight) as exc:
        _claim(lease)
    assert exc.value.details["expires_at"] == _ms_iso(now_ms + 1)
    set_meta(EnvironmentLease.objects.get(pk=lease.pk), pendingCleanupLeaseExpiresAtMs=now_ms)
    second = _claim(lease).attempt_id
    assert second != first
    reclaim = ActivityEvent.objects.get(
        entity_id=str(lease.pk), details__attemptId=second, action__endswith="cleanup_claimed"
    )
    assert (reclaim.details["previousAttemptId"], reclaim.details["reclaimedExpiredClaim"]) == (
        first,
        True,
    )


@pytest.mark.parametrize("expiry", [True, 9.9e15, "9999999999999", None])
def test_an_in_flight_claim_with_an_unreadable_expiry_counts_as_expired(
    company: Company, expiry: object
) -> None:
    lease = pending_cleanup_lease(company, intent=None)
    _claim(lease)
    set_meta(EnvironmentLease.objects.get(pk=lease.pk), pendingCleanupLeaseExpiresAtMs=expiry)
    assert _claim(lease).lease.metadata["pendingCleanupInFlight"] is True


def test_a_back_off_ending_now_is_over_one_ending_a_millisecond_later_is_not(
    company: Company, now_ms: int
) -> None:
    lease = pending_cleanup_lease(company, intent=None)
    set_meta(lease, pendingCleanupRetryAfterMs=now_ms + 1, pendingCleanupRetryAttempts=3)
    with pytest.raises(CleanupRetryNotDue) as exc:
        _claim(lease)
    assert exc.value.details == {"retry_at": _ms_iso(now_ms + 1), "attempts": 3}
    set_meta(EnvironmentLease.objects.get(pk=lease.pk), pendingCleanupRetryAfterMs=now_ms)
    assert _claim(lease).attempt_id


# --- the settle -----------------------------------------------------------------------------


@pytest.mark.parametrize(("intent", "state"), [(None, "destroyed"), ("stop_and_retain", "stopped")])
def test_a_settling_receipt_stores_the_termination_receipt_and_audits_it(
    company: Company, now_ms: int, intent: str | None, state: str
) -> None:
    lease = pending_cleanup_lease(company, intent=intent)
    attempt = _claim(lease).attempt_id
    settled = _settle(lease, attempt, state)
    assert (settled.status, settled.cleanup_status) == ("released", "success")
    assert "sandboxStopAndRetain" not in settled.metadata
    assert settled.metadata["remoteExecutionTermination"] == {
        "schema": "paperclip.remote-termination.v1",
        "companyId": str(company.pk),
        "runId": str(lease.heartbeat_run_id),
        "leaseId": str(lease.pk),
        "provider": lease.provider,
        "providerLeaseId": lease.provider_lease_id,
        "state": state,
        "confirmedAt": _ms_iso(now_ms),
    }
    audit = _audit(lease, "environment_lease.cleanup_settled")
    assert (audit.company_id, audit.actor_type, audit.actor_id) == (company.pk, "agent", "w-2")
    assert audit.run_id == lease.heartbeat_run_id
    assert audit.details == {
        "attemptId": attempt,
        "intent": "sandbox_stop_and_retain" if intent else None,
        "receiptState": state,
        "stopped": True,
        "status": "released",
    }


def test_a_receipt_that_does_not_settle_drops_an_earlier_termination_receipt(
    company: Company,
) -> None:
    lease = pending_cleanup_lease(company, intent=None)
    set_meta(lease, remoteExecutionTermination={"schema": "paperclip.remote-termination.v1"})
    attempt = _claim(lease).attempt_id
    failed = _settle(lease, attempt, "failed")
    assert (failed.status, failed.cleanup_status) == ("pending_cleanup", "failed")
    assert "remoteExecutionTermination" not in failed.metadata


def test_a_local_lease_settles_without_a_termination_receipt(company: Company) -> None:
    lease = pending_cleanup_lease(company, intent=None)
    EnvironmentLease.objects.filter(pk=lease.pk).update(provider="local")
    lease.refresh_from_db()
    set_meta(lease, remoteExecutionTermination={"schema": "paperclip.remote-termination.v1"})
    settled = _settle(lease, _claim(lease).attempt_id, "destroyed")
    assert settled.status == "released"
    assert "remoteExecutionTermination" not in settled.metadata


# --- the retry sweep ------------------------------------------------------------------------


def _failed(company: Company, **meta: Any) -> EnvironmentLease:
    return set_meta(pending_cleanup_lease(company, intent=None), **meta)


def test_the_retry_sweep_reopens_exactly_the_leases_whose_back_off_is_over(
    company: Company, now_ms: int
) -> None:
    due_now = _failed(company, pendingCleanupRetryAfterMs=now_ms, pendingCleanupRetryAttempts=2)
    claim_lapsing_now = _failed(
        company,
        pendingCleanupRetryAfterMs=now_ms - 5,
        pendingCleanupInFlight=True,
        pendingCleanupLeaseExpiresAtMs=now_ms,
    )
    not_yet = _failed(company, pendingCleanupRetryAfterMs=now_ms + 1)
    no_back_off = _failed(company, pendingCleanupRetryAfterMs=0)
    live_claim = _failed(
        company,
        pendingCleanupRetryAfterMs=now_ms - 5,
        pendingCleanupInFlight=True,
        pendingCleanupLeaseExpiresAtMs=now_ms + 1,
    )
    not_failed = _failed(company, pendingCleanupRetryAfterMs=now_ms - 5)
    EnvironmentLease.objects.filter(pk=not_failed.pk).update(cleanup_status="pending")
    released = _failed(company, pendingCleanupRetryAfterMs=now_ms - 5)
    EnvironmentLease.objects.filter(pk=released.pk).update(status="released")
    untouched = [not_yet, no_back_off, live_claim, not_failed, released]
    before = {lease.pk: EnvironmentLease.objects.get(pk=lease.pk) for lease in untouched}

    sweep = environment_cleanups_retry_due()

    reopened = sorted([due_now.pk, claim_lapsing_now.pk])
    assert sorted(sweep.reopened) == reopened
    assert sweep.examined == 2  # the two reopened; the live claim and the rest never match
    for pk in reopened:
        lease = EnvironmentLease.objects.get(pk=pk)
        assert lease.cleanup_status == "pending"
        assert lease.metadata["pendingCleanupRetryAfterMs"] == 0
        assert lease.metadata["pendingCleanupInFlight"] is False
    assert EnvironmentLease.objects.get(pk=due_now.pk).metadata["pendingCleanupRetryAttempts"] == 2
    for pk, old in before.items():
        now = EnvironmentLease.objects.get(pk=pk)
        assert (now.cleanup_status, now.metadata, now.updated_at) == (
            old.cleanup_status,
            old.metadata,
            old.updated_at,
        )
    audit = _audit(due_now, "environment_lease.cleanup_retry_due")
    assert (audit.company_id, audit.actor_type, audit.actor_id) == (
        company.pk,
        "system",
        "retry_environment_cleanups",
    )
    assert (audit.entity_type, audit.run_id) == ("environment_lease", due_now.heartbeat_run_id)
    assert audit.details == {"retryAttempts": 2}
    assert ActivityEvent.objects.filter(action="environment_lease.cleanup_retry_due").count() == 2


def test_the_retry_sweep_takes_at_most_a_batch(company: Company, now_ms: int) -> None:
    for _ in range(3):
        _failed(company, pendingCleanupRetryAfterMs=now_ms - 1)
    first = environment_cleanups_retry_due(batch_size=2)
    assert (first.examined, len(first.reopened)) == (2, 2)
    assert len(environment_cleanups_retry_due(batch_size=2).reopened) == 1


@pytest.mark.django_db(transaction=True)
def test_the_retry_sweep_skips_a_lease_another_transaction_holds(company: Company) -> None:
    """Rows held elsewhere are skipped and reopened next time; a sweep that waited for them
    instead would hit this session's lock timeout and fail."""
    past = int(db_now().timestamp() * 1000) - 1
    held, free = (_failed(company, pendingCleanupRetryAfterMs=past) for _ in range(2))
    with connection.cursor() as cursor:
        cursor.execute("SET lock_timeout = '5s'")
    try:
        with raw_connection(autocommit=False) as holder:
            holder.execute(
                "SELECT 1 FROM environment_leases WHERE id = %s FOR NO KEY UPDATE", [held.pk]
            )
            first = environment_cleanups_retry_due()
            holder.rollback()
        second = environment_cleanups_retry_due()
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET lock_timeout")
    assert (first.reopened, second.reopened) == ([free.pk], [held.pk])
