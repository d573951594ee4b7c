"""Row locks of the runtime-lease slice (the only place that builds them).

Lock order, everywhere: the execution workspace row (FOR NO KEY UPDATE, it carries the
generation counter) → the runtime lease row. Paths that touch only the lease row (renew,
owner release, force release, fenced writes, the sweep) take no workspace lock, so they can
never wait on it while holding the lease row, and the order cannot invert.

Writing owner FK columns takes FOR KEY SHARE on the referenced issue/run/agent rows after
the lease row is locked; KEY SHARE conflicts only with deleting those rows or changing their
keys, which nothing does while holding a lease row, and PostgreSQL skips the check when a
renew leaves the FK values unchanged.

Every helper here runs inside the caller's transaction; the callers set
`lock_timeout` first, so a wait is bounded and surfaces as `ResourceBusy`.
"""

from __future__ import annotations

from typing import Final, cast
from uuid import UUID

from django.db import connection

from leases.selectors import (
    LEASE_COLUMNS,
    LEASE_TABLE,
    RuntimeLease,
    StaleReason,
    owner_stale_reason_sql,
)
from paperclip.db.locking import require_transaction


def workspace_generation_for_update(
    *, company_id: UUID, execution_workspace_id: UUID
) -> int | None:
    """Lock the workspace row and return its last handed-out lease generation (None: no such
    workspace in the company). Serializes create, reclaim and the counter bump per workspace."""
    require_transaction()
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT runtime_lease_generation FROM execution_workspaces"
            " WHERE id = %s AND company_id = %s FOR NO KEY UPDATE",
            [execution_workspace_id, company_id],
        )
        row = cursor.fetchone()
    return None if row is None else int(row[0])


def runtime_lease_for_update(*, execution_workspace_id: UUID) -> RuntimeLease | None:
    """Lock the workspace's lease row exclusively (the claim is about to renew, reclaim or
    refuse it). None when there is no row (after waiting out a concurrent delete)."""
    require_transaction()
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT {LEASE_COLUMNS} FROM {LEASE_TABLE}"  # noqa: S608 - constant identifiers
            " WHERE execution_workspace_id = %s FOR UPDATE",
            [execution_workspace_id],
        )
        row = cursor.fetchone()
    return None if row is None else RuntimeLease.from_row(row)


_FOR_SHARE_SQL: Final = (
    f"SELECT {LEASE_COLUMNS}, "  # noqa: S608 - constant identifiers and SQL
    + owner_stale_reason_sql(
        company="%(company)s::uuid", issue="%(issue)s::uuid", run="%(run)s::uuid"
    )
    + f" FROM {LEASE_TABLE} WHERE execution_workspace_id = %(workspace)s FOR SHARE"
)


def runtime_lease_for_share(
    *,
    execution_workspace_id: UUID,
    company_id: UUID,
    owner_issue_id: UUID | None,
    owner_run_id: UUID | None,
) -> tuple[RuntimeLease, StaleReason | None] | None:
    """Share-lock the lease row for a fenced write: a concurrent reclaim, renew-by-update or
    release waits until the write commits, so "checked the generation" and "wrote under it"
    cannot interleave with a change of owner.

    The same statement judges the writer's own owner (the issue/run it names; only the lease
    row is locked): the lease and the stale reason a lease held by that owner would have
    (None: eligible, docs/leases.md#owner-eligibility). None when there is no lease row."""
    require_transaction()
    with connection.cursor() as cursor:
        cursor.execute(
            _FOR_SHARE_SQL,
            {
                "workspace": execution_workspace_id,
                "company": company_id,
                "issue": owner_issue_id,
                "run": owner_run_id,
            },
        )
        row = cursor.fetchone()
    if row is None:
        return None
    return RuntimeLease.from_row(row[:-1]), cast("StaleReason | None", row[-1])


def runtime_leases_lock_skip_locked(*, lease_ids: list[UUID]) -> list[UUID]:
    """Lock whichever of `lease_ids` nobody else holds (sweeper): a lease being renewed or
    reclaimed right now is skipped, never waited for."""
    require_transaction()
    if not lease_ids:
        return []
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT id FROM {LEASE_TABLE}"  # noqa: S608 - constant identifiers
            " WHERE id = ANY(%s) ORDER BY id FOR UPDATE SKIP LOCKED",
            [lease_ids],
        )
        return [row[0] for row in cursor.fetchall()]
