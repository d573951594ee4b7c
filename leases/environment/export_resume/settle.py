"""Settling a cleanup with a provider's reply: `export_resume_settle` for a lease held by its
export-resume marker, and the write both settle paths share (with its retry back-off)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from django.conf import settings
from django.db import transaction
from django.db.models.functions import Now

from leases.environment.export_resume.binding import lease_metadata
from leases.environment.export_resume.keys import (
    EXPORT_RESUME_KEY,
    REMOTE_TERMINATION_KEY,
    SYSTEM_ACTOR_ID,
    SYSTEM_ACTOR_TYPE,
)
from leases.environment.export_resume.markers import export_resume_read
from leases.environment.export_resume.termination import remote_termination_receipt
from leases.environment.locks import environment_leases_for_update
from leases.models import EnvironmentLease
from paperclip.activity import activity_record
from paperclip.db.clock import db_now
from paperclip.db.locking import require_transaction


def export_resume_settle(
    *,
    lease: EnvironmentLease,
    attempt_id: str,
    receipt: Mapping[str, Any] | None = None,
    status: Literal["released", "expired"] = "released",
    actor_type: str = SYSTEM_ACTOR_TYPE,
    actor_id: str = SYSTEM_ACTOR_ID,
) -> EnvironmentLease | None:
    """Apply a provider's stop reply (`receipt`: `{providerLeaseId, state}`) to a
    pending-cleanup export lease, as read earlier into `lease`.

    A `stopped` reply bound to this exact lease settles it: `status` (released or expired),
    cleanup `success`, marker removed, the termination receipt stored. Anything else keeps it
    `pending_cleanup` with cleanup `failed` and the marker kept. Always: `released_at`,
    `last_used_at` now, not in flight, claim expiry 0, any older receipt removed.

    Guard (re-checked on the locked row against the `lease` snapshot): same id, company, run,
    provider and allocation, still `pending_cleanup`, `pendingCleanupAttemptId == attempt_id`,
    the same marker request id and plugin pin. So a late receipt can never rewrite a rebound
    lease or a newer attempt. Returns the settled row, or None when the guard failed.
    Writes one audit row when it changes the lease. Locks: the lease row FOR NO KEY UPDATE.
    """
    marker = export_resume_read(lease)
    if marker is None:
        return None
    with transaction.atomic():  # composable into a caller's transaction
        current = (
            environment_leases_for_update()
            .filter(
                pk=lease.pk,
                company_id=lease.company_id,
                heartbeat_run_id=lease.heartbeat_run_id,
                provider=lease.provider,
                provider_lease_id=lease.provider_lease_id,
                status=EnvironmentLease.Status.PENDING_CLEANUP,
            )
            .first()
        )
        current_meta = lease_metadata(current) if current is not None else {}
        current_marker = current_meta.get(EXPORT_RESUME_KEY)
        if (
            current is None
            or current_meta.get("pendingCleanupAttemptId") != attempt_id
            or not isinstance(current_marker, dict)
            or current_marker.get("requestId") != marker.request_id
            or current_meta.get("pluginId") != marker.plugin_id
        ):
            return None
        bound = remote_termination_receipt(current, receipt, confirmed_at=db_now())
        stopped = bound is not None and bound["state"] == "stopped"
        dropped = (
            {REMOTE_TERMINATION_KEY, EXPORT_RESUME_KEY} if stopped else {REMOTE_TERMINATION_KEY}
        )
        metadata = {k: v for k, v in current_meta.items() if k not in dropped}
        if stopped:
            metadata[REMOTE_TERMINATION_KEY] = bound
        return cleanup_settle_write_in_tx(
            current,
            metadata=metadata,
            settles=stopped,
            settled_status=status,
            actor_type=actor_type,
            actor_id=actor_id,
            attempt_id=attempt_id,
            intent="export_resume",
            receipt_state=receipt.get("state") if isinstance(receipt, Mapping) else None,
            extra={"requestId": marker.request_id},
        )


def cleanup_retry_after_ms(attempts: int) -> int:
    """When a cleanup that failed `attempts` times may be claimed again (epoch ms, database
    clock): PAPERCLIP_CLEANUP_RETRY_BASE_SECONDS doubling per attempt, capped at
    PAPERCLIP_CLEANUP_RETRY_CAP_SECONDS."""
    base = settings.PAPERCLIP_CLEANUP_RETRY_BASE_SECONDS
    delay = min(base * 2 ** max(attempts - 1, 0), settings.PAPERCLIP_CLEANUP_RETRY_CAP_SECONDS)
    return int(db_now().timestamp() * 1000) + int(delay * 1000)


def cleanup_settle_write_in_tx(
    lease: EnvironmentLease,
    *,
    metadata: dict[str, Any],
    settles: bool,
    settled_status: str,
    actor_type: str,
    actor_id: str,
    attempt_id: str,
    intent: str | None,
    receipt_state: object,
    extra: dict[str, Any] | None = None,
) -> EnvironmentLease:
    """Write a provider reply's outcome onto the locked lease, the one way both settle paths
    (export-resume and the plain cleanup protocol) do it: `settled_status` with cleanup
    success when the reply settles, otherwise `pending_cleanup` with cleanup failed; the claim
    is cleared either way, so the next claim retries. `metadata` is the lease's new metadata.
    One audit row (`environment_lease.cleanup_settled`); returns the lease re-read."""
    require_transaction()
    metadata.update(pendingCleanupInFlight=False, pendingCleanupLeaseExpiresAtMs=0)
    retry: dict[str, int] = {}
    if not settles:
        # A reply that does not settle is a failed attempt: the next claim waits out a
        # back-off on the database clock (docs/environment.md#cleanup-retries).
        attempts = metadata.get("pendingCleanupRetryAttempts")
        attempts = (attempts if isinstance(attempts, int) and attempts >= 0 else 0) + 1
        retry_after_ms = cleanup_retry_after_ms(attempts)
        metadata.update(
            pendingCleanupRetryAttempts=attempts, pendingCleanupRetryAfterMs=retry_after_ms
        )
        retry = {"retryAttempts": attempts, "retryAfterMs": retry_after_ms}
    new_status = settled_status if settles else EnvironmentLease.Status.PENDING_CLEANUP
    cleanup = (
        EnvironmentLease.CleanupStatus.SUCCESS if settles else EnvironmentLease.CleanupStatus.FAILED
    )
    EnvironmentLease.objects.filter(pk=lease.pk).update(
        status=new_status,
        cleanup_status=cleanup,
        released_at=Now(),
        last_used_at=Now(),
        updated_at=Now(),
        metadata=metadata,
    )
    activity_record(
        company_id=lease.company_id,
        actor_type=actor_type,
        actor_id=actor_id,
        action="environment_lease.cleanup_settled",
        entity_type="environment_lease",
        entity_id=lease.pk,
        run_id=lease.heartbeat_run_id,
        details={
            "attemptId": attempt_id,
            "intent": intent,
            **(extra or {}),
            **retry,
            "receiptState": receipt_state,
            "stopped": settles,
            "status": new_status,
        },
    )
    lease.refresh_from_db()
    return lease
