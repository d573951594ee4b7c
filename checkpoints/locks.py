"""The only place that builds the checkpoints app's locking statements.

Lock order (see `paperclip/db/advisory.py`): the coordinator row (`native_run_finalizations`,
app `paperclip`) first, then rows of this app (checkpoint parts, the work memory). Callers
start their transaction with `set_local_lock_timeout()`, so a stuck holder surfaces as the retryable
`ResourceBusy` instead of a hung request. Row locks are `FOR NO KEY UPDATE`: nothing here
changes a key, and it still excludes every other writer and `FOR UPDATE` locker of the row.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from django.db import connection

from paperclip.db.locking import busy_on_lock_timeout, require_transaction


@dataclass(frozen=True, slots=True)
class LockedCoordinator:
    """The coordinator columns a decision needs, read under its row lock, with the database
    time sampled after the lock was granted."""

    run_id: UUID
    company_id: UUID
    issue_id: UUID
    phase: str
    lease_owner: str | None
    lease_expires_at: datetime | None
    controller_boot_id: str | None
    controller_generation: int
    result_id: UUID | None
    now: datetime

    @property
    def lease_active(self) -> bool:
        return (
            self.lease_owner is not None
            and self.lease_expires_at is not None
            and self.lease_expires_at > self.now
        )


# The locking SELECT lives in a CTE and clock_timestamp() in the outer projection: the outer
# row is only produced after LockRows has waited for and granted the lock, so the sampled time
# is never older than the lock (sampling inside the locking SELECT could precede the wait).
_COORDINATOR_COLUMNS = (
    "run_id, company_id, issue_id, phase, lease_owner, lease_expires_at, "
    "controller_boot_id, controller_generation, result_id"
)

_LOCK_COORDINATOR_SQL = f"""
WITH locked AS (
    SELECT {_COORDINATOR_COLUMNS}
    FROM native_run_finalizations
    WHERE run_id = %s
    FOR NO KEY UPDATE
)
SELECT {_COORDINATOR_COLUMNS}, clock_timestamp() FROM locked
"""  # noqa: S608 - constant column list, values are bound

_LOCK_OWNER_SQL = f"""
WITH locked AS (
    SELECT {_COORDINATOR_COLUMNS}
    FROM native_run_finalizations
    WHERE company_id = %s AND issue_id = %s AND run_id = %s
      AND controller_boot_id = %s AND controller_generation = %s
    FOR NO KEY UPDATE
)
SELECT {_COORDINATOR_COLUMNS}, clock_timestamp() FROM locked
"""  # noqa: S608 - constant column list, values are bound


def _fetch_locked(sql: str, params: list[Any]) -> LockedCoordinator | None:
    require_transaction()
    with busy_on_lock_timeout(resource="native_run_finalization"), connection.cursor() as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
    return None if row is None else LockedCoordinator(*row)


def coordinator_lock(run_id: UUID) -> LockedCoordinator | None:
    """Lock the run's coordinator row (no-key update: nothing here changes its key)."""
    return _fetch_locked(_LOCK_COORDINATOR_SQL, [run_id])


def checkpoint_owner_lock(
    *, company_id: UUID, issue_id: UUID, authority_run_id: UUID, boot_id: str, generation: int
) -> LockedCoordinator | None:
    """The owner fence's lock: the authority run's coordinator, only if it is still on the
    presented boot and generation (None otherwise: the owner is lost)."""
    return _fetch_locked(
        _LOCK_OWNER_SQL, [company_id, issue_id, authority_run_id, boot_id, generation]
    )


def checkpoint_work_lock(run_id: UUID) -> tuple[str, list[str]] | None:
    """The run's remembered (lease_owner, work_command_ids), locked for this write."""
    require_transaction()
    with busy_on_lock_timeout(resource="native_run_finalization"), connection.cursor() as cursor:
        cursor.execute(
            "SELECT lease_owner, work_command_ids FROM native_runner_checkpoint_work "
            "WHERE run_id = %s FOR NO KEY UPDATE",
            [run_id],
        )
        row = cursor.fetchone()
    if row is None:
        return None
    # Django's psycopg setup hands raw-cursor jsonb back as text.
    ids = json.loads(row[1]) if isinstance(row[1], str) else row[1]
    return row[0], [str(i) for i in ids or []]


def expired_authorities_claim(run_ids: list[UUID]) -> list[LockedCoordinator]:
    """Lock the still-expired coordinators among `run_ids`, skipping any another transaction
    holds (a sweeper must not queue behind a live writer; it will see the row next time)."""
    require_transaction()
    if not run_ids:
        return []
    sql = f"""
    WITH locked AS (
        SELECT {_COORDINATOR_COLUMNS}
        FROM native_run_finalizations f
        WHERE f.run_id = ANY(%s)
        ORDER BY f.run_id
        FOR NO KEY UPDATE SKIP LOCKED
    )
    SELECT {_COORDINATOR_COLUMNS}, clock_timestamp() FROM locked ORDER BY run_id
    """  # noqa: S608 - constant column list, values are bound
    with connection.cursor() as cursor:
        cursor.execute(sql, [run_ids])
        rows = cursor.fetchall()
    return [LockedCoordinator(*row) for row in rows]
