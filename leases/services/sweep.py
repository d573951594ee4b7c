"""Sweep stale runtime leases (`sweep_runtime_leases`, docs/leases.md).

Candidates are listed without locks, then each batch is locked with SKIP LOCKED and re-checked
under the lock, so a lease claimed, renewed or reclaimed meanwhile is left alone. Each deletion
is audited with actor `system`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final
from uuid import UUID

from django.db import connection, transaction

from leases import locks
from leases.models import WorkspaceRuntimeLease
from leases.selectors import (
    LEASE_TABLE,
    STALE,
    STALE_REASON,
    runtime_lease_stale_page,
    with_stale_reason,
)
from leases.services.shared import audit
from leases.services.types import RuntimeLeaseSweepBatch, RuntimeLeaseSweepReport
from paperclip.errors import InvalidRequest

SWEEP_ACTOR_ID: Final = "sweep_runtime_leases"


def runtime_lease_sweep_batch(*, lease_ids: list[UUID]) -> RuntimeLeaseSweepBatch:
    """Delete those of `lease_ids` whose owner is still stale when re-checked under the row
    lock. A lease being claimed right now is skipped (SKIP LOCKED); one renewed or reclaimed
    since it was listed survives the re-check. Audits each deletion (actor `system`).
    """
    with transaction.atomic(durable=True):
        locked = locks.runtime_leases_lock_skip_locked(lease_ids=lease_ids)
        # A fresh statement after taking the locks: it sees every commit made before them.
        still_stale = list(
            with_stale_reason(WorkspaceRuntimeLease.objects.filter(pk__in=locked))
            .filter(**STALE)
            .order_by("pk")
            .values_list(
                "pk",
                "company_id",
                "execution_workspace_id",
                "owner_key",
                "generation",
                STALE_REASON,
            )
        )
        doomed = [row[0] for row in still_stale]
        if doomed:
            with connection.cursor() as cursor:
                cursor.execute(
                    f"DELETE FROM {LEASE_TABLE} WHERE id = ANY(%s)",  # noqa: S608
                    [doomed],
                )
        for lease_id, company_id, workspace_id, owner_key, generation, reason in still_stale:
            audit(
                owner_actor=("system", SWEEP_ACTOR_ID),
                company_id=company_id,
                execution_workspace_id=workspace_id,
                action="runtime_lease.swept",
                run_id=None,
                details={
                    "lease_id": str(lease_id),
                    "owner_key": owner_key,
                    "generation": generation,
                    "reason": reason,
                },
            )
    return RuntimeLeaseSweepBatch(
        examined=len(lease_ids),
        skipped_locked=len(lease_ids) - len(locked),
        survived=len(locked) - len(doomed),
        deleted=tuple((row[0], row[5]) for row in still_stale),
    )


# Floors of live leases that have passed, moved up to their expiry: `FOR NO KEY UPDATE SKIP
# LOCKED` so that a renew or claim holding a row is never waited for (its row is taken by the
# next sweep), in id order and in batches, each its own statement.
_RAISE_FLOORS_SQL: Final = (
    f"WITH due AS (SELECT id FROM {LEASE_TABLE}"  # noqa: S608
    " WHERE expiry_floor <= now() AND expires_at > now()"
    " ORDER BY id LIMIT %s FOR NO KEY UPDATE SKIP LOCKED)"
    f" UPDATE {LEASE_TABLE} l SET expiry_floor = l.expires_at FROM due WHERE l.id = due.id"
)


def runtime_lease_floors_raise(*, batch_size: int = 1000) -> int:
    """Move the expiry floor of every live lease whose floor has passed up to its
    `expires_at` (docs/data-model.md#expiry-floor); how many rows moved.

    A renew leaves the floor alone (so that it is an in-place update), which lets the floors
    of renewed leases fall behind; this keeps the expiry candidates few. It changes no lease's
    meaning (the floor is an index hint, never a verdict), so it writes no audit row.
    """
    raised = 0
    while True:
        with transaction.atomic(durable=True), connection.cursor() as cursor:
            cursor.execute(_RAISE_FLOORS_SQL, [batch_size])
            moved = cursor.rowcount
        raised += moved
        if moved < batch_size:
            return raised


def runtime_lease_sweep(
    *,
    batch_size: int = 500,
    dry_run: bool = False,
    on_batch: Callable[[int, RuntimeLeaseSweepBatch], None] | None = None,
) -> RuntimeLeaseSweepReport:
    """Delete every lease whose owner is stale, `batch_size` per transaction.

    Candidates are listed without locks in id order (keyset pagination, so skipped or
    surviving rows are never revisited and the sweep terminates), then each batch goes
    through `runtime_lease_sweep_batch`. With `dry_run` nothing is locked or deleted and the
    batches report what would be deleted. `on_batch(number, batch)` reports progress.
    """
    if batch_size < 1:
        raise InvalidRequest(fields={"batch_size": ["Must be a positive integer."]})
    report = RuntimeLeaseSweepReport(dry_run=dry_run)
    if not dry_run:
        report.floors_raised = runtime_lease_floors_raise()
    after: UUID | None = None
    while True:
        page = runtime_lease_stale_page(after_id=after, limit=batch_size)
        if not page:
            return report
        after = page[-1][0]
        if dry_run:
            batch = RuntimeLeaseSweepBatch(
                examined=len(page),
                skipped_locked=0,
                survived=0,
                deleted=tuple((lease_id, reason) for lease_id, reason in page),  # type: ignore[misc]
            )
        else:
            batch = runtime_lease_sweep_batch(lease_ids=[lease_id for lease_id, _ in page])
        report.batches += 1
        report.examined += batch.examined
        report.skipped_locked += batch.skipped_locked
        report.survived += batch.survived
        report.by_reason.update(reason for _, reason in batch.deleted)
        if on_batch is not None:
            on_batch(report.batches, batch)
        if len(page) < batch_size:
            # A short page listed every stale lease after `after`: another would only run the
            # listing's anti-join over the owned leases again to find leases gone stale since,
            # which the next sweep finds anyway.
            return report
