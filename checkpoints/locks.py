"""The only place that builds the checkpoints app's locking querysets and statements.

Lock order (see `paperclip/db/advisory.py`): the coordinator row (`NativeRunFinalization`,
app `paperclip`) first, then rows of this app (the work memory, checkpoint parts). Callers
start their transaction with `set_local_lock_timeout()`, so a stuck holder surfaces as the retryable
`ResourceBusy` instead of a hung request. Row locks are `FOR NO KEY UPDATE`: nothing here
changes a key, and it still excludes every other writer and `FOR UPDATE` locker of the row.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final
from uuid import UUID

from django.db import connection
from django.db.models import Field, Model, QuerySet

from checkpoints.models import NativeRunnerCheckpoint, NativeRunnerCheckpointWork
from paperclip.db.locking import busy_on_lock_timeout, require_transaction
from paperclip.db.sql import quoted_column, quoted_table
from paperclip.models import NativeRunFinalization


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


@dataclass(frozen=True, slots=True)
class LockedCheckpointOwner:
    """What the checkpoint writer's fence decides on: the authority run's coordinator and the
    written run's work memory (None when it has none yet), both locked, with the coordinator's
    `now` sampled after both locks were granted."""

    coordinator: LockedCoordinator
    remembered: tuple[str, list[str]] | None  # (lease_owner, work_command_ids)


# The `NativeRunFinalization` fields behind `LockedCoordinator` (its attributes but `now`).
COORDINATOR_FIELDS: Final = (
    "run",
    "company",
    "issue",
    "phase",
    "lease_owner",
    "lease_expires_at",
    "controller_boot_id",
    "controller_generation",
    "result",
)
WORK_FIELDS: Final = ("lease_owner", "work_command_ids")


def _column(model: type[Model], name: str) -> str:
    field: Field[Any, Any] = model._meta.get_field(name)  # type: ignore[assignment]
    return quoted_column(field)


def _where(model: type[Model], names: tuple[str, ...]) -> str:
    """SQL: each of `names` equals its bound parameter, in this order."""
    return " AND ".join(f"{_column(model, name)} = %s" for name in names)


_COORDINATOR_COLUMNS: Final = ", ".join(
    _column(NativeRunFinalization, name) for name in COORDINATOR_FIELDS
)


def _coordinator_lock_sql(*where_fields: str) -> str:
    """Lock the coordinator row matching `where_fields` (each `= %s`, in this order)."""
    # Raw because the ORM cannot project over a locking CTE: the outer row is only produced
    # after LockRows has waited for and granted the lock, so clock_timestamp() there is never
    # older than the lock (sampled inside the locking SELECT, it could precede the wait).
    return (
        f"WITH locked AS (SELECT {_COORDINATOR_COLUMNS} FROM {quoted_table(NativeRunFinalization)}"  # noqa: S608 - identifiers from _meta, values bound
        f" WHERE {_where(NativeRunFinalization, where_fields)} FOR NO KEY UPDATE)"
        f" SELECT {_COORDINATOR_COLUMNS}, clock_timestamp() FROM locked"
    )


def _owner_lock_sql() -> str:
    """Lock the authority run's coordinator (if still on the presented boot and generation),
    then the written run's work memory; parameters: the coordinator's, then the run id."""
    work = NativeRunnerCheckpointWork
    where = ("company", "issue", "run", "controller_boot_id", "controller_generation")
    work_columns = ", ".join(_column(work, name) for name in WORK_FIELDS)
    # Raw for the same guarantee over both locks the fence decides on: the work row's CTE only
    # runs once `locked` has produced the coordinator (its EXISTS reads it), so the order is
    # coordinator then work memory (none if the owner is lost), and clock_timestamp() in the
    # outer row postdates both lock waits.
    return (
        f"WITH locked AS (SELECT {_COORDINATOR_COLUMNS} FROM {quoted_table(NativeRunFinalization)}"  # noqa: S608 - identifiers from _meta, values bound
        f" WHERE {_where(NativeRunFinalization, where)} FOR NO KEY UPDATE),"
        f" work AS (SELECT {work_columns} FROM {quoted_table(work)}"
        f" WHERE {_where(work, ('run',))} AND EXISTS (SELECT FROM locked) FOR NO KEY UPDATE)"
        f" SELECT locked.*, clock_timestamp(), work.* FROM locked LEFT JOIN work ON true"
    )


_LOCK_COORDINATOR_SQL: Final = _coordinator_lock_sql("run")
_LOCK_OWNER_SQL: Final = _owner_lock_sql()


def coordinator_lock(run_id: UUID) -> LockedCoordinator | None:
    """Lock the run's coordinator row (no-key update: nothing here changes its key)."""
    require_transaction()
    with busy_on_lock_timeout(resource="native_run_finalization"), connection.cursor() as cursor:
        cursor.execute(_LOCK_COORDINATOR_SQL, [run_id])
        row = cursor.fetchone()
    return None if row is None else LockedCoordinator(*row)


def checkpoint_owner_lock(
    *,
    company_id: UUID,
    issue_id: UUID,
    authority_run_id: UUID,
    boot_id: str,
    generation: int,
    run_id: UUID,
) -> LockedCheckpointOwner | None:
    """The owner fence's locks: the authority run's coordinator, only if it is still on the
    presented boot and generation (None otherwise: the owner is lost, and nothing else is
    locked), then the work memory of `run_id`, the run whose checkpoint is written."""
    require_transaction()
    params: list[Any] = [company_id, issue_id, authority_run_id, boot_id, generation, run_id]
    with busy_on_lock_timeout(resource="native_run_finalization"), connection.cursor() as cursor:
        cursor.execute(_LOCK_OWNER_SQL, params)
        row = cursor.fetchone()
    if row is None:
        return None
    columns = len(COORDINATOR_FIELDS) + 1  # and `now`
    coordinator = LockedCoordinator(*row[:columns])
    lease_owner, ids = row[columns:]
    if lease_owner is None:  # no work row (the column is NOT NULL)
        return LockedCheckpointOwner(coordinator=coordinator, remembered=None)
    # Django's psycopg setup hands raw-cursor jsonb back as text.
    ids = json.loads(ids) if isinstance(ids, str) else ids
    return LockedCheckpointOwner(
        coordinator=coordinator, remembered=(lease_owner, [str(i) for i in ids or []])
    )


def checkpoint_parts_for_update() -> QuerySet[NativeRunnerCheckpoint]:
    return NativeRunnerCheckpoint.objects.select_for_update(no_key=True, of=("self",)).order_by(
        "pk"
    )


def expired_authorities_claim(run_ids: list[UUID]) -> list[NativeRunFinalization]:
    """Lock the coordinators among `run_ids` (only the `COORDINATOR_FIELDS` loaded), skipping
    any another transaction holds (a sweeper must not queue behind a live writer; it will see
    the row next time). The caller re-checks expiry under these locks."""
    require_transaction()
    if not run_ids:
        return []
    return list(
        NativeRunFinalization.objects.select_for_update(no_key=True, skip_locked=True, of=("self",))
        .filter(pk__in=run_ids)
        .order_by("pk")
        .only(*COORDINATOR_FIELDS)
    )
