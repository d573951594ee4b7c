"""The provider cleanup protocol: workers claim a pending cleanup, then report a receipt.

A lease in `pending_cleanup` is claimed for 15 minutes (database clock) with a fresh attempt
id kept in `metadata.pendingCleanupAttemptId`; the claim is the only attempt whose receipt is
accepted. A receipt for an older attempt, another allocation, an unclaimed or already settled
lease changes nothing (`cleanup_attempt_stale`). Leases with a stop-only intent (an
export-resume marker or a stop-and-retain intent) settle only on `stopped`: such an
allocation must never be destroyed by cleanup.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, Literal
from uuid import UUID

from django.db import transaction
from django.db.models import Q
from django.db.models.functions import Now

from leases.environment.errors import (
    CleanupAttemptStale,
    CleanupInFlight,
    CleanupIntentInvalid,
    CleanupNotPending,
    CleanupRetryNotDue,
    EnvironmentLeaseNotFound,
)
from leases.environment.export_resume.keys import (
    EXPORT_RESUME_KEY,
    REMOTE_TERMINATION_KEY,
    STOP_AND_RETAIN_KEY,
)
from leases.environment.export_resume.markers import (
    export_resume_has,
    stop_only_cleanup_has,
    stop_only_cleanup_read,
)
from leases.environment.export_resume.settle import cleanup_settle_write_in_tx, export_resume_settle
from leases.environment.export_resume.termination import remote_termination_receipt
from leases.environment.locks import environment_leases_for_update
from leases.models import EnvironmentLease
from paperclip.activity import activity_record, row_update_audited
from paperclip.db.clock import db_now
from paperclip.db.locking import bounded_lock_wait

CLEANUP_CLAIM_TTL_MS: Final = 15 * 60 * 1000
ReceiptState = Literal["stopped", "destroyed", "failed"]


@dataclass(frozen=True, slots=True)
class CleanupClaim:
    attempt_id: str
    lease: EnvironmentLease
    stop_only: bool  # True: the worker may only stop the allocation, never destroy it
    expires_at: datetime


def _ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


def _claim_expiry_ms(metadata: dict[str, Any]) -> int:
    value = metadata.get("pendingCleanupLeaseExpiresAtMs")
    # An unreadable expiry counts as expired: a stuck claim would strand the allocation.
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _locked_lease(*, lease_id: UUID, company_id: UUID) -> EnvironmentLease:
    # A racing worker waits for the winner's short transaction and then sees its claim, so it
    # gets a meaningful `cleanup_in_flight` instead of a bare "busy".
    with bounded_lock_wait(resource="environment_lease"):
        lease = environment_leases_for_update().filter(pk=lease_id, company_id=company_id).first()
    if lease is None:
        raise EnvironmentLeaseNotFound()
    return lease


def environment_lease_cleanup_claim(
    *,
    lease_id: UUID,
    company_id: UUID,
    actor_type: str,
    actor_id: str,
    attempt_id: str | None = None,
) -> CleanupClaim:
    """Claim the lease's pending cleanup for 15 minutes with a fresh attempt id.

    Claimable: status `pending_cleanup`, no live claim (not in flight, or the in-flight
    claim's `pendingCleanupLeaseExpiresAtMs` has passed on the database clock), and the back-off
    after a failed attempt over (`pendingCleanupRetryAfterMs`, database clock). A lease with a
    stop-only intent that does not bind to it is never claimable. `attempt_id` lets an
    in-process owner (the finalization ownership token) claim under its own token; workers
    over HTTP always get a fresh uuid. Writes one audit row.

    Locks: the lease row FOR NO KEY UPDATE with a 5 s lock timeout (two racing workers: the
    second waits, then sees the first claim). Raises EnvironmentLeaseNotFound (also for
    another company's lease), CleanupNotPending, CleanupInFlight, CleanupRetryNotDue,
    CleanupIntentInvalid, ResourceBusy.
    """
    with transaction.atomic(durable=True):
        lease = _locked_lease(lease_id=lease_id, company_id=company_id)
        if lease.status != EnvironmentLease.Status.PENDING_CLEANUP:
            raise CleanupNotPending(status=lease.status)
        if stop_only_cleanup_has(lease) and stop_only_cleanup_read(lease) is None:
            intent = EXPORT_RESUME_KEY if export_resume_has(lease) else STOP_AND_RETAIN_KEY
            raise CleanupIntentInvalid(intent=intent)
        metadata = dict(lease.metadata) if isinstance(lease.metadata, dict) else {}
        now_ms = _ms(db_now())
        previous_expiry = _claim_expiry_ms(metadata)
        in_flight = metadata.get("pendingCleanupInFlight") is True
        if in_flight and previous_expiry > now_ms:
            raise CleanupInFlight(
                expires_at=datetime.fromtimestamp(previous_expiry / 1000, tz=UTC).isoformat()
            )
        retry_after = metadata.get("pendingCleanupRetryAfterMs")
        if (
            isinstance(retry_after, int)
            and not isinstance(retry_after, bool)
            and (retry_after > now_ms)
        ):
            raise CleanupRetryNotDue(
                retry_at=datetime.fromtimestamp(retry_after / 1000, tz=UTC).isoformat(),
                attempts=metadata.get("pendingCleanupRetryAttempts"),
            )
        attempt = attempt_id or str(uuid.uuid4())
        expires_ms = now_ms + CLEANUP_CLAIM_TTL_MS
        previous_attempt = metadata.get("pendingCleanupAttemptId")
        metadata.update(
            pendingCleanupAttemptId=attempt,
            pendingCleanupInFlight=True,
            pendingCleanupLeaseExpiresAtMs=expires_ms,
        )
        row_update_audited(
            lease,
            {"metadata": metadata, "updated_at": Now()},
            company_id=lease.company_id,
            actor_type=actor_type,
            actor_id=actor_id,
            action="environment_lease.cleanup_claimed",
            entity_type="environment_lease",
            entity_id=lease.pk,
            run_id=lease.heartbeat_run_id,
            details={
                "attemptId": attempt,
                "previousAttemptId": previous_attempt,
                "expiresAtMs": expires_ms,
                "reclaimedExpiredClaim": in_flight,
            },
        )
    return CleanupClaim(
        attempt_id=attempt,
        lease=lease,
        stop_only=stop_only_cleanup_has(lease),
        expires_at=datetime.fromtimestamp(expires_ms / 1000, tz=UTC),
    )


def environment_lease_cleanup_settle(
    *,
    lease_id: UUID,
    company_id: UUID,
    attempt_id: str,
    provider_lease_id: str,
    state: ReceiptState,
    actor_type: str,
    actor_id: str,
) -> EnvironmentLease:
    """Apply a worker's cleanup receipt to the lease it claimed; return the settled lease.

    Accepted only for the lease's live attempt: status `pending_cleanup`, in flight, the same
    `pendingCleanupAttemptId`, and the receipt naming the lease's own allocation. Then:
    - export-resume marker: `export_resume_settle` (only `stopped` settles);
    - stop-and-retain intent: only `stopped` settles (released, cleanup success, intent and
      claim cleared, termination receipt stored);
    - otherwise: `stopped`/`destroyed` settle as released with cleanup success;
    - any reply that does not settle keeps `pending_cleanup`, cleanup `failed`, not in flight
      (the next claim retries it).
    Writes one audit row. Locks: the lease row FOR NO KEY UPDATE (5 s lock timeout).
    Raises EnvironmentLeaseNotFound, CleanupAttemptStale (nothing changed), ResourceBusy.
    """
    with transaction.atomic(durable=True):
        lease = _locked_lease(lease_id=lease_id, company_id=company_id)
        metadata = dict(lease.metadata) if isinstance(lease.metadata, dict) else {}
        if lease.status != EnvironmentLease.Status.PENDING_CLEANUP:
            raise CleanupAttemptStale(reason="not_pending")
        if metadata.get("pendingCleanupInFlight") is not True:
            raise CleanupAttemptStale(reason="not_claimed")
        if metadata.get("pendingCleanupAttemptId") != attempt_id:
            raise CleanupAttemptStale(reason="attempt_mismatch")
        if not lease.provider_lease_id or provider_lease_id != lease.provider_lease_id:
            raise CleanupAttemptStale(reason="provider_lease_mismatch")
        reply = {"providerLeaseId": provider_lease_id, "state": state}
        if export_resume_has(lease):
            settled = export_resume_settle(
                lease=lease,
                attempt_id=attempt_id,
                receipt=reply,
                actor_type=actor_type,
                actor_id=actor_id,
            )
            if settled is None:
                raise CleanupAttemptStale(reason="lease_changed")
            return settled
        return _settle_generic(
            lease, metadata, attempt_id=attempt_id, reply=reply, actor=(actor_type, actor_id)
        )


def _settle_generic(
    lease: EnvironmentLease,
    metadata: dict[str, Any],
    *,
    attempt_id: str,
    reply: dict[str, str],
    actor: tuple[str, str],
) -> EnvironmentLease:
    stop_only = STOP_AND_RETAIN_KEY in metadata
    if stop_only and stop_only_cleanup_read(lease) is None:
        raise CleanupAttemptStale(reason="lease_changed")
    settles = reply["state"] == "stopped" or (not stop_only and reply["state"] == "destroyed")
    metadata.pop(REMOTE_TERMINATION_KEY, None)
    if settles:
        metadata.pop(STOP_AND_RETAIN_KEY, None)
        receipt = remote_termination_receipt(lease, reply, confirmed_at=db_now())
        if receipt is not None:
            metadata[REMOTE_TERMINATION_KEY] = receipt
    return cleanup_settle_write_in_tx(
        lease,
        metadata=metadata,
        settles=settles,
        settled_status=EnvironmentLease.Status.RELEASED,
        actor_type=actor[0],
        actor_id=actor[1],
        attempt_id=attempt_id,
        intent="sandbox_stop_and_retain" if stop_only else None,
        receipt_state=reply["state"],
    )


@dataclass(frozen=True, slots=True)
class CleanupRetrySweep:
    examined: int
    reopened: list[UUID]


def environment_cleanups_retry_due(*, batch_size: int = 200) -> CleanupRetrySweep:
    """Reopen the failed cleanups whose back-off is over (the worker's periodic task): a
    `pending_cleanup` lease with cleanup `failed`, no live claim and
    `pendingCleanupRetryAfterMs` reached on the database clock goes back to cleanup `pending`
    with the back-off cleared and its attempt count kept, so providers listing pending work see
    it again. One audit row per lease (`environment_lease.cleanup_retry_due`). Rows another
    transaction holds are skipped (SKIP LOCKED) and picked up next time; before its time a lease
    is left alone, and claims keep being refused (`cleanup_retry_not_due`).
    """
    with transaction.atomic(durable=True):
        now_ms = _ms(db_now())
        candidates = list(
            environment_leases_for_update(skip_locked=True)
            .filter(
                status=EnvironmentLease.Status.PENDING_CLEANUP,
                cleanup_status=EnvironmentLease.CleanupStatus.FAILED,
                metadata__pendingCleanupRetryAfterMs__gt=0,
                metadata__pendingCleanupRetryAfterMs__lte=now_ms,
            )
            # A live claim is left out before the limit, not after: a batch of them would
            # otherwise be all the sweep ever looks at.
            # (Each test true or false, never null: a missing key must not hide the row.)
            .exclude(
                Q(metadata__contains={"pendingCleanupInFlight": True})
                & Q(metadata__has_key="pendingCleanupLeaseExpiresAtMs")
                & Q(metadata__pendingCleanupLeaseExpiresAtMs__gt=now_ms)
            )[:batch_size]
        )
        reopened: list[UUID] = []
        for lease in candidates:
            metadata = dict(lease.metadata) if isinstance(lease.metadata, dict) else {}
            if (
                metadata.get("pendingCleanupInFlight") is True
                and _claim_expiry_ms(metadata) > now_ms
            ):
                continue
            metadata.update(pendingCleanupRetryAfterMs=0, pendingCleanupInFlight=False)
            EnvironmentLease.objects.filter(pk=lease.pk).update(
                cleanup_status=EnvironmentLease.CleanupStatus.PENDING,
                metadata=metadata,
                updated_at=Now(),
            )
            activity_record(
                company_id=lease.company_id,
                actor_type="system",
                actor_id="retry_environment_cleanups",
                action="environment_lease.cleanup_retry_due",
                entity_type="environment_lease",
                entity_id=lease.pk,
                run_id=lease.heartbeat_run_id,
                details={"retryAttempts": metadata.get("pendingCleanupRetryAttempts")},
            )
            reopened.append(lease.pk)
    return CleanupRetrySweep(examined=len(candidates), reopened=reopened)


@dataclass(frozen=True, slots=True)
class CleanupRetryNow:
    lease: EnvironmentLease
    reopened: bool  # False: already pending with no back-off (nothing written)


def environment_lease_cleanup_retry_now(
    *,
    company_ids: frozenset[UUID] | None,
    lease_id: UUID,
    actor_type: str,
    actor_id: str,
    reason: str,
) -> CleanupRetryNow:
    """The board's "retry cleanup now": a pending cleanup whose last attempt failed, or that
    waits out its back-off, is reopened at once (cleanup `pending`, back-off cleared, attempt
    count kept), as the retry sweep does when the back-off is over; the provider's next claim
    takes it. A cleanup already pending with no back-off answers `reopened=False` and writes
    nothing. One audit row (`environment_lease.cleanup_retry_requested`, with `reason`).

    `company_ids` limits which leases the actor may see (None: all). Locks: the lease row FOR
    NO KEY UPDATE with a 5 s lock timeout. Raises EnvironmentLeaseNotFound (also another
    company's), CleanupNotPending (not `pending_cleanup`), CleanupInFlight (a live claim: its
    receipt decides first), ResourceBusy.
    """
    with transaction.atomic(durable=True):
        with bounded_lock_wait(resource="environment_lease"):
            lease = environment_leases_for_update().filter(pk=lease_id).first()
        if lease is None or (company_ids is not None and lease.company_id not in company_ids):
            raise EnvironmentLeaseNotFound()
        if lease.status != EnvironmentLease.Status.PENDING_CLEANUP:
            raise CleanupNotPending(status=lease.status)
        metadata = dict(lease.metadata) if isinstance(lease.metadata, dict) else {}
        now_ms = _ms(db_now())
        expiry = _claim_expiry_ms(metadata)
        if metadata.get("pendingCleanupInFlight") is True and expiry > now_ms:
            raise CleanupInFlight(
                expires_at=datetime.fromtimestamp(expiry / 1000, tz=UTC).isoformat()
            )
        retry_after = metadata.get("pendingCleanupRetryAfterMs")
        backing_off = isinstance(retry_after, int) and retry_after > now_ms
        if lease.cleanup_status == EnvironmentLease.CleanupStatus.PENDING and not backing_off:
            return CleanupRetryNow(lease=lease, reopened=False)
        metadata.update(pendingCleanupRetryAfterMs=0, pendingCleanupInFlight=False)
        row_update_audited(
            lease,
            {
                "cleanup_status": EnvironmentLease.CleanupStatus.PENDING,
                "metadata": metadata,
                "updated_at": Now(),
            },
            company_id=lease.company_id,
            actor_type=actor_type,
            actor_id=actor_id,
            action="environment_lease.cleanup_retry_requested",
            entity_type="environment_lease",
            entity_id=lease.pk,
            run_id=lease.heartbeat_run_id,
            details={
                "reason": reason,
                "retryAttempts": metadata.get("pendingCleanupRetryAttempts"),
                "retryAfterMs": retry_after,
            },
        )
    return CleanupRetryNow(lease=lease, reopened=True)
