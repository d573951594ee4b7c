"""The expired-authority sweep: `controller_leases_expire`, which the
`expire_runner_authorities` command calls once per batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from uuid import UUID

from django.db import transaction
from django.db.models.functions import Coalesce, Now

from checkpoints import locks
from checkpoints.selectors import expired_authorities
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
