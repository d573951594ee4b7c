"""The expired-authority sweep: `controller_leases_expire` for one batch, and
`expired_authorities_sweep`, the batch loop that `manage.py expire_runner_authorities` and the
worker's periodic task both run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from uuid import UUID

from django.db import transaction
from django.db.models.functions import Coalesce, Now

from checkpoints import locks
from checkpoints.selectors import expired_authorities, list_expired_authorities
from checkpoints.services.shared import live_run_recovery_notify
from paperclip.activity import activity_record
from paperclip.db.clock import ClockTimestamp
from paperclip.models import NativeRunFinalization


@dataclass(frozen=True, slots=True)
class AuthorityExpiry:
    expired: list[UUID]
    skipped: list[UUID]  # busy (locked elsewhere), already clear, or no longer due


def controller_leases_expire(*, run_ids: list[UUID]) -> AuthorityExpiry:
    """Expire the controller leases of the given runs that are still expired authorities
    (see `selectors.list_expired_authorities`): clear `lease_owner`, keep the expiry (or stamp
    it when there was none), NOTIFY `paperclip_live_run_recovery`, audit each.

    Re-checks every condition under the row lock; rows another transaction holds are skipped
    (SKIP LOCKED) and picked up on a later sweep. Call once per batch.
    Audit: `controller_lease.expired` per run, actor `system`.
    """
    with transaction.atomic(durable=True):
        claimed = {c.run_id: c for c in locks.expired_authorities_claim(run_ids)}
        if not claimed:
            return AuthorityExpiry(expired=[], skipped=list(run_ids))
        # The claimed rows are ours until commit, so the coordinator conditions cannot change
        # between this re-check (database clock) and the UPDATE.
        done = list(
            expired_authorities(clock=ClockTimestamp())
            .filter(pk__in=list(claimed), lease_owner__isnull=False)
            .order_by("pk")
            .values_list("pk", flat=True)
        )
        if done:
            NativeRunFinalization.objects.filter(pk__in=done).update(
                lease_owner=None,
                lease_expires_at=Coalesce("lease_expires_at", ClockTimestamp()),
                updated_at=Now(),
            )
        for run_id in done:
            prior = claimed[run_id]
            live_run_recovery_notify(company_id=prior.company_id, run_id=run_id)
            activity_record(
                company_id=prior.company_id,
                actor_type="system",
                actor_id="expire_runner_authorities",
                action="controller_lease.expired",
                entity_type="native_run_finalization",
                entity_id=run_id,
                run_id=run_id,
                details={
                    "bootId": prior.controller_boot_id,
                    "generation": prior.controller_generation,
                    "leaseExpiresAt": prior.lease_expires_at.isoformat()
                    if prior.lease_expires_at
                    else None,
                },
            )
    done_set = set(done)
    return AuthorityExpiry(expired=done, skipped=[r for r in run_ids if r not in done_set])


@dataclass(frozen=True, slots=True)
class AuthoritySweep:
    found: int
    expired: int
    skipped: int
    batches: int


def expired_authorities_sweep(
    *,
    batch_size: int = 200,
    on_batch: Callable[[int, list[UUID], AuthorityExpiry], None] | None = None,
) -> AuthoritySweep:
    """Expire every expired authority (`list_expired_authorities`), `batch_size` per
    transaction; what `manage.py expire_runner_authorities` and the worker's periodic task run.
    `on_batch(number, found_ids, expiry)` reports each batch."""
    after: UUID | None = None
    batches = found = expired = skipped = 0
    while True:
        run_ids = list_expired_authorities(after=after, limit=batch_size)
        if not run_ids:
            break
        batches += 1
        found += len(run_ids)
        after = run_ids[-1]
        result = controller_leases_expire(run_ids=run_ids)
        expired += len(result.expired)
        skipped += len(result.skipped)
        if on_batch is not None:
            on_batch(batches, run_ids, result)
    return AuthoritySweep(found, expired, skipped, batches)
