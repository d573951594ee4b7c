"""The run's controller lease: acquire, renew and take over (`controller_lease_acquire`), and
the writer-failure hook that ends it early (`controller_lease_expire_on_failure`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal
from uuid import UUID

from django.db import transaction
from django.db.models.functions import Now

from checkpoints import locks
from checkpoints.errors import ControllerLeaseHeld, ControllerLeaseRunTerminal
from checkpoints.selectors import RunnerRun, runner_run_get
from paperclip.activity import activity_record
from paperclip.db.clock import ClockTimestamp
from paperclip.db.locking import busy_on_lock_timeout, require_transaction, set_local_lock_timeout
from paperclip.errors import InvalidRequest
from paperclip.models import HeartbeatRun, NativeRunFinalization
from paperclip.observability import metrics

CONTROLLER_LEASE_TTL_MIN = 10
CONTROLLER_LEASE_TTL_MAX = 3600
CONTROLLER_LEASE_TTL_DEFAULT = 60
# controller_generation is an int4 that saturates (docs/checkpoints.md#generation-saturation):
# the lease_owner's random part still fences a saturated generation.
GENERATION_MAX = 2**31 - 1


@dataclass(frozen=True, slots=True)
class ControllerLease:
    lease_owner: str
    controller_boot_id: str
    generation: int
    lease_expires_at: datetime
    outcome: Literal["acquired", "renewed", "taken_over"]


def _coordinator_ensure(run: RunnerRun) -> bool:
    """Create the run's coordinator (phase observed) if it is missing; True if created.

    The core API creates it with every native run; this covers runs made before that or by
    other paths. The primary key makes two racing first acquirers agree on one row: the loser
    waits for the winner's insert, then reads the winner's row.
    """
    require_transaction()
    with busy_on_lock_timeout(resource="native_run_finalization"):
        _, created = NativeRunFinalization.objects.get_or_create(
            run_id=run.run_id, defaults={"company_id": run.company_id, "issue_id": run.issue_id}
        )
    return created


def _coordinator_update(run_id: UUID, **values: Any) -> NativeRunFinalization:
    """One UPDATE of the coordinator row this transaction holds locked; fields set to an
    expression come back (RETURNING) on the instance returned."""
    require_transaction()
    coordinator = NativeRunFinalization(run_id=run_id)
    for name, value in values.items():
        setattr(coordinator, name, value)
    coordinator.save(update_fields=list(values))
    return coordinator


def controller_lease_acquire(
    *,
    run_id: UUID,
    agent_id: UUID,
    boot_id: str,
    lease_owner: str | None = None,
    ttl_seconds: int = CONTROLLER_LEASE_TTL_DEFAULT,
) -> ControllerLease:
    """Acquire, renew or take over the run's controller lease for the controller `boot_id`.

    Renew: `lease_owner` is the current, unexpired owner on the same boot → same generation,
    expiry moved to now + ttl. Acquire/take over: no lease, or it has expired → a new
    `<boot_id>:<generation>:<uuid>` owner with generation + 1. Otherwise ControllerLeaseHeld.
    Creates a missing coordinator for a native run with an issue.

    Locks: the coordinator row (no-key update), with the time sampled after the lock.
    Raises: NotFoundError, PermissionDenied (not the run's agent), ControllerLeaseRunNotNative,
    ControllerLeaseRunTerminal, ControllerLeaseHeld, InvalidRequest (ttl), ResourceBusy.
    Audit: `controller_lease.acquired` / `controller_lease.taken_over` (renewals are not
    audited: they carry no decision and would flood the log).
    """
    if not CONTROLLER_LEASE_TTL_MIN <= ttl_seconds <= CONTROLLER_LEASE_TTL_MAX:
        raise InvalidRequest(
            fields={
                "ttl_seconds": [f"Must be {CONTROLLER_LEASE_TTL_MIN}..{CONTROLLER_LEASE_TTL_MAX}."]
            }
        )
    run = runner_run_get(run_id=run_id, agent_id=agent_id)
    with transaction.atomic(durable=True):
        set_local_lock_timeout()
        created = False
        current = locks.coordinator_lock(run.run_id)
        if current is None:
            created = _coordinator_ensure(run)
            current = locks.coordinator_lock(run.run_id)
        if current is None:  # pragma: no cover - just ensured; coordinators are never deleted
            raise RuntimeError(f"coordinator of run {run.run_id} vanished")
        # Re-read under the coordinator lock: the run may have finished since the check above.
        status = HeartbeatRun.objects.filter(pk=run.run_id).values_list("status", flat=True).get()
        if status in HeartbeatRun.TERMINAL_STATUSES:
            raise ControllerLeaseRunTerminal(run_id=str(run.run_id), status=status)

        if current.lease_active:
            if lease_owner == current.lease_owner and boot_id == current.controller_boot_id:
                return _lease_renew(current, ttl_seconds)
            raise ControllerLeaseHeld(
                controller_boot_id=current.controller_boot_id,
                generation=current.controller_generation,
                lease_expires_at=current.lease_expires_at.isoformat()
                if current.lease_expires_at
                else None,
            )
        return _lease_mint(
            current, run=run, boot_id=boot_id, ttl_seconds=ttl_seconds, created=created
        )


def _lease_renew(current: locks.LockedCoordinator, ttl_seconds: int) -> ControllerLease:
    require_transaction()
    renewed = _coordinator_update(
        current.run_id,
        lease_expires_at=ClockTimestamp() + timedelta(seconds=ttl_seconds),
        updated_at=Now(),
    )
    expires_at = renewed.lease_expires_at
    if expires_at is None:  # pragma: no cover - just set to a timestamp
        raise RuntimeError(f"coordinator of run {current.run_id} has no lease expiry")
    transaction.on_commit(metrics.CONTROLLER_LEASES.labels("renewed").inc)  # no audit row
    return ControllerLease(
        lease_owner=str(current.lease_owner),
        controller_boot_id=str(current.controller_boot_id),
        generation=current.controller_generation,
        lease_expires_at=expires_at,
        outcome="renewed",
    )


def _lease_mint(
    current: locks.LockedCoordinator,
    *,
    run: RunnerRun,
    boot_id: str,
    ttl_seconds: int,
    created: bool,
) -> ControllerLease:
    require_transaction()
    generation = min(current.controller_generation + 1, GENERATION_MAX)
    owner = f"{boot_id}:{generation}:{uuid.uuid4()}"
    minted = _coordinator_update(
        current.run_id,
        lease_owner=owner,
        controller_boot_id=boot_id,
        controller_generation=generation,
        controller_pid=None,
        controller_process_started_at=None,
        lease_expires_at=ClockTimestamp() + timedelta(seconds=ttl_seconds),
        updated_at=Now(),
    )
    expires_at = minted.lease_expires_at
    if expires_at is None:  # pragma: no cover - just set to a timestamp
        raise RuntimeError(f"coordinator of run {current.run_id} has no lease expiry")
    # A takeover whenever a controller held this run before, also when a sweep has since
    # cleared its lease_owner (expire_runner_authorities keeps the boot and generation).
    takeover = current.lease_owner is not None or current.controller_boot_id is not None
    activity_record(
        company_id=run.company_id,
        actor_type="agent",
        actor_id=str(run.agent_id),
        action="controller_lease.taken_over" if takeover else "controller_lease.acquired",
        entity_type="native_run_finalization",
        entity_id=run.run_id,
        run_id=run.run_id,
        details={
            "bootId": boot_id,
            "generation": generation,
            "ttlSeconds": ttl_seconds,
            "previousBootId": current.controller_boot_id,
            "previousGeneration": current.controller_generation,
            "previousLeaseExpiresAt": current.lease_expires_at.isoformat()
            if current.lease_expires_at
            else None,
            "coordinatorCreated": created,
        },
    )
    return ControllerLease(
        lease_owner=owner,
        controller_boot_id=boot_id,
        generation=generation,
        lease_expires_at=expires_at,
        outcome="taken_over" if takeover else "acquired",
    )


def controller_lease_expire_on_failure(
    *, run_id: UUID, agent_id: UUID, boot_id: str, lease_owner: str
) -> bool:
    """The writer-failure hook: end the lease now, so the controller must re-acquire.

    Only while the same boot and owner still hold an unexpired lease and no result exists: a
    late hook from an old controller must not cut short its successor's lease, and a run with
    an accepted result is past the point where its controller lease matters. Returns whether
    the lease was expired.

    Locks: the coordinator row (the UPDATE, whose conditions PostgreSQL re-checks on the row
    once it holds the lock, the clock included). Audit: `controller_lease.expired_on_failure`.
    """
    run = runner_run_get(run_id=run_id, agent_id=agent_id)
    with transaction.atomic(durable=True):
        set_local_lock_timeout()
        coordinator = NativeRunFinalization.objects.filter(pk=run.run_id)
        with busy_on_lock_timeout(resource="native_run_finalization"):
            expired = coordinator.filter(
                company_id=run.company_id,
                issue_id=run.issue_id,
                controller_boot_id=boot_id,
                lease_owner=lease_owner,
                result__isnull=True,
                lease_expires_at__gt=ClockTimestamp(),
            ).update(lease_expires_at=ClockTimestamp(), updated_at=Now())
        if not expired:
            return False
        # The row is ours until commit (the UPDATE locked it), so this is the generation ended.
        generation = coordinator.values_list("controller_generation", flat=True).get()
        activity_record(
            company_id=run.company_id,
            actor_type="agent",
            actor_id=str(run.agent_id),
            action="controller_lease.expired_on_failure",
            entity_type="native_run_finalization",
            entity_id=run.run_id,
            run_id=run.run_id,
            details={"bootId": boot_id, "generation": generation},
        )
    return True
