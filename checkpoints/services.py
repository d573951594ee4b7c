"""Writes of the checkpoints app: the controller lease, the fenced checkpoint writer, the
writer-failure hook, the expired-authority sweep and key rotation.

Clock: every expiry decision uses the database's `clock_timestamp()` sampled after the row lock
it depends on (see `checkpoints.locks`), never the application server's clock. Raw SQL is kept
only where it buys such a guarantee (the coordinator locks in `checkpoints.locks`) and for
NOTIFY, which has no ORM spelling.
"""

from __future__ import annotations

import json
import unicodedata
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal
from uuid import UUID

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Exists, OuterRef, Q, QuerySet, TextField
from django.db.models.fields.json import KT
from django.db.models.functions import Cast, Coalesce, Now

from checkpoints import locks
from checkpoints.crypto import (
    Binding,
    KeyUnavailable,
    decrypt_part,
    encrypt_part,
    keyring,
)
from checkpoints.errors import (
    CheckpointBindingMismatch,
    CheckpointOwnerLost,
    CheckpointUnreadable,
    ControllerLeaseHeld,
    ControllerLeaseRunTerminal,
)
from checkpoints.models import NativeRunnerCheckpoint, NativeRunnerCheckpointWork
from checkpoints.selectors import RunnerRun, expired_authorities, runner_run_get
from paperclip.activity import activity_record
from paperclip.db.clock import ClockTimestamp
from paperclip.db.locking import busy_on_lock_timeout, require_transaction, set_local_lock_timeout
from paperclip.errors import InvalidRequest
from paperclip.models import HeartbeatRun, Issue, NativeRunFinalization

CONTROLLER_LEASE_TTL_MIN = 10
CONTROLLER_LEASE_TTL_MAX = 3600
CONTROLLER_LEASE_TTL_DEFAULT = 60
# controller_generation is an int4 that saturates (docs/checkpoints.md#generation-saturation):
# the lease_owner's random part still fences a saturated generation.
GENERATION_MAX = 2**31 - 1

MAX_PART_NAME_CHARS = 200
MAX_WORK_COMMAND_ID_CHARS = 200
MAX_WORK_COMMAND_IDS = 10_000
LIVE_RUN_RECOVERY_CHANNEL = "paperclip_live_run_recovery"


def max_part_bytes() -> int:
    return int(getattr(settings, "PAPERCLIP_CHECKPOINT_MAX_PART_BYTES", 8 * 1024 * 1024))


def max_write_bytes() -> int:
    return int(getattr(settings, "PAPERCLIP_CHECKPOINT_MAX_WRITE_BYTES", 16 * 1024 * 1024))


def max_parts_per_write() -> int:
    return int(getattr(settings, "PAPERCLIP_CHECKPOINT_MAX_PARTS_PER_WRITE", 10_000))


def _live_run_recovery_notify(*, company_id: UUID, run_id: UUID) -> None:
    """Wake live-run recovery listeners for the run, at this transaction's commit."""
    require_transaction()
    with connection.cursor() as cursor:
        # Raw: NOTIFY has no ORM spelling. Sent inside the transaction, it is delivered only at
        # commit, after the row locks are released, so a listener never wakes before the write.
        cursor.execute(
            "SELECT pg_notify(%s, %s)",
            [
                LIVE_RUN_RECOVERY_CHANNEL,
                json.dumps({"companyId": str(company_id), "runId": str(run_id)}),
            ],
        )


# --- Controller lease -----------------------------------------------------------------------


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


# --- The fenced checkpoint writer -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CheckpointOwner:
    """What a controller presents: its boot, its lease token, the generation it was given, and
    the run whose coordinator carries the lease (default: the checkpoint's own run)."""

    boot_id: str
    lease_owner: str
    generation: int
    authority_run_id: UUID | None = None


@dataclass(frozen=True, slots=True)
class Predecessor:
    run_id: UUID
    normalized_session_id: UUID


@dataclass(frozen=True, slots=True)
class CheckpointWrite:
    parts: int  # parts stored for the run after the write
    owner_active: bool  # False: tolerated as an expired owner with a result (§3.5)
    changed: int
    removed: int


def _invalid_part_name(name: object) -> str | None:
    if not isinstance(name, str) or not name:
        return "Part names are non-empty strings."
    if len(name) > MAX_PART_NAME_CHARS:
        return f"Part names are at most {MAX_PART_NAME_CHARS} characters."
    if any(unicodedata.category(ch) in ("Cc", "Cs") for ch in name):
        return "Part names contain no control characters."
    return None


def _invalid_text(value: str) -> bool:
    if "\x00" in value:
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def checkpoint_write_validate(
    *, changed: Mapping[str, str], removed: Sequence[str], work_command_ids: Sequence[str]
) -> None:
    """Database-free checks of a write; InvalidRequest (400) naming the fields."""
    errors: dict[str, list[str]] = {}
    for name in [*changed, *removed]:
        problem = _invalid_part_name(name)
        if problem:
            errors.setdefault("changed" if name in changed else "removed", []).append(
                f"{name!r}: {problem}"[:300]
            )
    if len(changed) > max_parts_per_write():
        errors.setdefault("changed", []).append(f"At most {max_parts_per_write()} parts a write.")
    total = 0
    for name, contents in changed.items():
        if not isinstance(contents, str):
            errors.setdefault("changed", []).append(f"{name!r}: contents must be a string.")
            continue
        try:
            size = len(contents.encode("utf-8"))
        except UnicodeEncodeError:
            errors.setdefault("changed", []).append(
                f"{name!r}: contents are not valid Unicode (lone surrogate)."[:300]
            )
            continue
        total += size
        if size > max_part_bytes():
            errors.setdefault("changed", []).append(
                f"{name!r}: {size} bytes exceeds the part limit of {max_part_bytes()}."[:300]
            )
    if total > max_write_bytes():
        errors.setdefault("changed", []).append(
            f"{total} bytes in one write exceeds the limit of {max_write_bytes()}."
        )
    both = sorted(set(changed) & set(removed))
    if both:
        errors.setdefault("removed", []).append(
            f"Parts both changed and removed: {', '.join(map(repr, both[:5]))}."[:300]
        )
    if len(work_command_ids) > MAX_WORK_COMMAND_IDS:
        errors.setdefault("work_command_ids", []).append(f"At most {MAX_WORK_COMMAND_IDS} ids.")
    if any(
        not isinstance(i, str) or not i or len(i) > MAX_WORK_COMMAND_ID_CHARS
        for i in work_command_ids
    ):
        errors.setdefault("work_command_ids", []).append(
            f"Ids are non-empty strings of at most {MAX_WORK_COMMAND_ID_CHARS} characters."
        )
    elif any(_invalid_text(i) for i in work_command_ids):
        # Stored in jsonb, which cannot hold NUL or unpaired surrogates.
        errors.setdefault("work_command_ids", []).append(
            "Ids contain no NUL characters or unpaired surrogates."
        )
    if errors:
        raise InvalidRequest(fields=errors)


def _owner_validate(
    locked: locks.LockedCoordinator, owner: CheckpointOwner, binding: Binding, *, new_work: bool
) -> bool:
    """The fence (docs/checkpoints.md#owner-fence): True for an active owner; False for a
    tolerated inactive one; CheckpointOwnerLost otherwise. Runs under the coordinator lock."""
    require_transaction()
    if locked.lease_owner == owner.lease_owner and locked.lease_active:
        return True
    if locked.result_id is None:
        raise CheckpointOwnerLost(reason="lease_not_held")
    if new_work:
        raise CheckpointOwnerLost(reason="new_work_after_lease")
    # A legitimate successor on the same controller boot: a native coordinator with an
    # unexpired lease, or a legacy run still preparing under an unexpired controller lease
    # and without a coordinator. The controller boot is the presenting owner's (this server
    # has no controller process of its own; see the README, "Runner checkpoints").
    native_successor = NativeRunFinalization.objects.filter(
        run_id=OuterRef("execution_run_id"),
        company_id=binding.company_id,
        issue_id=binding.issue_id,
        controller_boot_id=owner.boot_id,
        lease_expires_at__gt=ClockTimestamp(),
    )
    legacy_successor = HeartbeatRun.objects.alias(
        boot_text=Cast("controller_boot_id", TextField())
    ).filter(
        ~Exists(NativeRunFinalization.objects.filter(run_id=OuterRef("pk"))),
        pk=OuterRef("execution_run_id"),
        company_id=binding.company_id,
        issue_id=binding.issue_id,
        runtime_mode=HeartbeatRun.RuntimeMode.LEGACY,
        status=HeartbeatRun.Status.RUNNING,
        execution_stage="preparing",
        boot_text=owner.boot_id,
        controller_lease_expires_at__gt=ClockTimestamp(),
    )
    issue = (
        Issue.objects.filter(company_id=binding.company_id, pk=binding.issue_id)
        .annotate(successor=Exists(native_successor) | Exists(legacy_successor))
        .values_list("execution_run_id", "successor")
        .first()
    )
    if issue is None:
        raise CheckpointOwnerLost(reason="issue_missing")
    execution_run_id, successor = issue
    if execution_run_id is None or execution_run_id == binding.run_id:
        return False
    if not successor:
        raise CheckpointOwnerLost(reason="issue_rebound")
    return False


def _predecessor_check(predecessor: Predecessor, binding: Binding) -> None:
    require_transaction()
    found = HeartbeatRun.objects.filter(
        pk=predecessor.run_id,
        company_id=binding.company_id,
        native_issue_id=binding.issue_id,
        native_session_id=predecessor.normalized_session_id,
    ).exists()
    if not found:
        raise CheckpointBindingMismatch(
            reason="predecessor_mismatch", predecessor_run_id=str(predecessor.run_id)
        )


def checkpoint_write(
    *,
    run_id: UUID,
    agent_id: UUID,
    owner: CheckpointOwner,
    reset: bool,
    changed: Mapping[str, str],
    removed: Sequence[str],
    work_command_ids: Sequence[str],
    predecessor: Predecessor | None,
) -> CheckpointWrite:
    """Persist one checkpoint snapshot of the run, fenced by the controller lease.

    Changed parts are encrypted before the transaction (no crypto under a row lock). Inside it:
    the owner fence (coordinator of the authority run, on the presented boot and generation,
    locked with the time sampled after the lock); the predecessor check; a live-run-recovery
    NOTIFY; `reset` (delete every part) or deletion of `removed`; an upsert of the changed
    parts on (run, part); the remembered work command ids; one audit row. The write costs what
    it changes, not what the run stores.

    Locks, in order: the coordinator row, the run's work-memory row, the changed part rows.
    Raises: InvalidRequest (names, sizes), NotFoundError, PermissionDenied,
    ControllerLeaseRunNotNative, CheckpointOwnerLost, CheckpointBindingMismatch, ResourceBusy.
    """
    checkpoint_write_validate(changed=changed, removed=removed, work_command_ids=work_command_ids)
    run = runner_run_get(run_id=run_id, agent_id=agent_id)
    binding = run.binding
    authority_run_id = owner.authority_run_id or run.run_id
    key = keyring(create=True).primary
    parts = [
        NativeRunnerCheckpoint(
            company_id=binding.company_id,
            issue_id=binding.issue_id,
            run_id=binding.run_id,
            part=name,
            material=encrypt_part(binding, name, contents, key),
            size_bytes=len(contents.encode("utf-8")),
        )
        for name, contents in changed.items()
    ]
    work_ids = list(dict.fromkeys(work_command_ids))

    with transaction.atomic(durable=True):
        set_local_lock_timeout()
        fence = locks.checkpoint_owner_lock(
            company_id=binding.company_id,
            issue_id=binding.issue_id,
            authority_run_id=authority_run_id,
            boot_id=owner.boot_id,
            generation=owner.generation,
            run_id=binding.run_id,
        )
        if fence is None:
            raise CheckpointOwnerLost(reason="generation_or_boot_changed")
        locked, remembered = fence.coordinator, fence.remembered
        previous = (
            set(remembered[1]) if remembered and remembered[0] == owner.lease_owner else set()
        )
        new_work = any(i not in previous for i in work_ids)
        active = _owner_validate(locked, owner, binding, new_work=new_work)
        if predecessor is not None:
            _predecessor_check(predecessor, binding)
        removed_count = _parts_apply(binding, reset, removed, parts)
        _work_remember(binding, owner.lease_owner, work_ids)
        _live_run_recovery_notify(company_id=binding.company_id, run_id=run.run_id)
        count = NativeRunnerCheckpoint.objects.filter(run_id=binding.run_id).count()
        activity_record(
            company_id=binding.company_id,
            actor_type="agent",
            actor_id=str(run.agent_id),
            action="checkpoint.written",
            entity_type="heartbeat_run",
            entity_id=run.run_id,
            run_id=run.run_id,
            details={
                "authorityRunId": str(authority_run_id),
                "generation": owner.generation,
                "ownerActive": active,
                "reset": reset,
                "changed": len(parts),
                "removed": removed_count,
                "keyId": key.key_id,
            },
        )
    return CheckpointWrite(
        parts=count, owner_active=active, changed=len(parts), removed=removed_count
    )


def _parts_apply(
    binding: Binding, reset: bool, removed: Sequence[str], parts: list[NativeRunnerCheckpoint]
) -> int:
    require_transaction()
    removed_count = 0
    with busy_on_lock_timeout(resource="native_run_finalization"):
        if reset or removed:
            doomed = NativeRunnerCheckpoint.objects.filter(
                company_id=binding.company_id, issue_id=binding.issue_id, run_id=binding.run_id
            )
            if not reset:
                doomed = doomed.filter(part__in=removed)
            removed_count, _ = doomed.delete()
        if parts:
            # created_at/updated_at are left to their database default (now).
            NativeRunnerCheckpoint.objects.bulk_create(
                parts,
                update_conflicts=True,
                unique_fields=["run", "part"],
                update_fields=["material", "size_bytes", "updated_at"],
            )
    return removed_count


def _work_remember(binding: Binding, lease_owner: str, work_ids: list[str]) -> None:
    require_transaction()
    with busy_on_lock_timeout(resource="native_run_finalization"):
        NativeRunnerCheckpointWork.objects.bulk_create(
            [
                NativeRunnerCheckpointWork(
                    run_id=binding.run_id,
                    company_id=binding.company_id,
                    issue_id=binding.issue_id,
                    lease_owner=lease_owner,
                    work_command_ids=work_ids,
                )
            ],
            update_conflicts=True,
            unique_fields=["run"],
            update_fields=["lease_owner", "work_command_ids", "updated_at"],
        )


# --- Sweeper: expired controller authorities -------------------------------------------------


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
            _live_run_recovery_notify(company_id=prior.company_id, run_id=run_id)
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


# --- Key rotation ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RotationBatch:
    scanned: int
    reencrypted: int
    unreadable: list[tuple[UUID, str, str]]  # (row id, part, reason): left as they are
    last_id: UUID | None  # resume after this id; None when nothing was left to scan
    primary_key_id: str


ROTATION_BATCH_MAX_BYTES = 64 * 1024 * 1024


def _parts_not_under(
    key_id: str, parts: QuerySet[NativeRunnerCheckpoint]
) -> QuerySet[NativeRunnerCheckpoint]:
    """`parts` whose envelope's keyId IS DISTINCT FROM `key_id` (missing and null included)."""
    return parts.alias(envelope_key_id=KT("material__keyId")).filter(
        Q(envelope_key_id__isnull=True) | ~Q(envelope_key_id=key_id)
    )


def checkpoint_key_rotate_batch(
    *, after_id: UUID | None, batch_size: int, max_bytes: int = ROTATION_BATCH_MAX_BYTES
) -> RotationBatch:
    """Re-encrypt up to `batch_size` parts not under the primary key (ordered by id, after
    `after_id`), stopping early once `max_bytes` of contents are in the batch (at least one
    part is always taken), so a batch of large parts cannot exhaust memory or hold its row
    locks for long. Resumable: parts already under the primary key are never selected, so a
    re-run after an interruption continues where the last committed batch stopped.

    Parts that fail to decrypt (key lost, tampered) are left unchanged and reported.
    Locks: the batch's part rows (no-key update), under the lock timeout; a part re-keyed by a
    writer meanwhile is skipped.
    Raises KeyUnavailable (no key at all), InvalidRequest (bounds), ResourceBusy.
    Audit: one `checkpoint_key.rotated` row per batch that changed anything (actor system).
    """
    if batch_size < 1:
        raise InvalidRequest(fields={"batch_size": ["Must be at least 1."]})
    if max_bytes < 1:
        raise InvalidRequest(fields={"max_bytes": ["Must be at least 1."]})
    ring = keyring(create=False)
    primary = ring.primary
    with transaction.atomic(durable=True):
        set_local_lock_timeout()
        # Choose the batch from sizes alone (no ciphertext loaded), then lock and load it.
        pending = _parts_not_under(primary.key_id, NativeRunnerCheckpoint.objects.all())
        if after_id is not None:
            pending = pending.filter(pk__gt=after_id)
        candidates: list[UUID] = []
        budget = 0
        for row_id, size in pending.order_by("pk").values_list("pk", "size_bytes")[:batch_size]:
            budget += int(size)
            if candidates and budget > max_bytes:
                break
            candidates.append(row_id)
        if not candidates:
            return RotationBatch(0, 0, [], None, primary.key_id)
        with busy_on_lock_timeout(resource="native_run_finalization"):
            rows = list(
                _parts_not_under(primary.key_id, locks.checkpoint_parts_for_update())
                .filter(pk__in=candidates)
                .only("company_id", "issue_id", "run_id", "part", "material")
            )
        last_id = candidates[-1]
        reencrypted: list[NativeRunnerCheckpoint] = []
        unreadable: list[tuple[UUID, str, str]] = []
        from_keys: set[str] = set()
        for row in rows:
            binding = Binding(company_id=row.company_id, issue_id=row.issue_id, run_id=row.run_id)
            try:
                contents = decrypt_part(binding, row.part, row.material, ring)
            except CheckpointUnreadable as exc:
                unreadable.append((row.pk, row.part, str(exc.details.get("reason"))))
                continue
            from_keys.add(str(row.material.get("keyId")))
            row.material = encrypt_part(binding, row.part, contents, primary)
            reencrypted.append(row)
        if reencrypted:
            NativeRunnerCheckpoint.objects.bulk_update(reencrypted, ["material"])
            activity_record(
                company_id=None,
                actor_type="system",
                actor_id="rotate_checkpoint_key",
                action="checkpoint_key.rotated",
                entity_type="checkpoint_key",
                entity_id=primary.key_id,
                details={
                    "toKeyId": primary.key_id,
                    "fromKeyIds": sorted(from_keys),
                    "reencrypted": len(reencrypted),
                    "unreadable": len(unreadable),
                    "firstId": str(candidates[0]),
                    "lastId": str(last_id),
                },
            )
    return RotationBatch(len(candidates), len(reencrypted), unreadable, last_id, primary.key_id)


def checkpoint_parts_remaining_under_old_keys() -> int:
    """How many parts are not under the primary key (0 after a complete rotation)."""
    try:
        primary = keyring(create=False).primary
    except KeyUnavailable:
        return 0
    return _parts_not_under(primary.key_id, NativeRunnerCheckpoint.objects.all()).count()
