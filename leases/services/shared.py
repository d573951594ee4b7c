"""Helpers several runtime-lease service modules share.

`preconditions` opens the transaction of every claim, release and fenced write: it bounds lock
waits for the rest of the transaction and checks, in one round trip, that the workspace, issue
and run are the company's (for a claim it also judges whether the owner itself is still
eligible). `audit` writes the one activity row per audited lease change (claim, release, fenced
write, sweep). `fetch_lease` runs a raw lease statement and maps its row; `lease_details` is
the lease part of an audit row; `iso` and `str_or_none` are the text forms audit rows and
errors use.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Final, cast
from uuid import UUID

from django.db import connection

from leases.errors import (
    ExecutionWorkspaceNotFound,
    OwnerIssueNotFound,
    OwnerRunForeign,
    OwnerRunNotFound,
)
from leases.selectors import RuntimeLease, StaleReason, owner_stale_reason_sql
from leases.services.types import RuntimeLeaseOwner
from paperclip.activity import activity_record
from paperclip.db import locking
from paperclip.db.locking import require_transaction

ENTITY_TYPE: Final = "execution_workspace"


def iso(value: datetime) -> str:
    """ISO-8601 in UTC with `Z`, the same text DRF renders for the lease's datetimes."""
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


def str_or_none(value: UUID | None) -> str | None:
    return None if value is None else str(value)


_PRECONDITIONS_SQL: Final = (
    "SELECT set_config('lock_timeout', %(timeout)s, true),"
    " EXISTS (SELECT 1 FROM execution_workspaces WHERE id = %(workspace)s"
    "  AND company_id = %(company)s),"
    " EXISTS (SELECT 1 FROM issues WHERE id = %(issue)s AND company_id = %(company)s),"
    " (SELECT agent_id FROM heartbeat_runs WHERE id = %(run)s AND company_id = %(company)s)"
)
_PRECONDITIONS_JUDGING_OWNER_SQL: Final = (
    _PRECONDITIONS_SQL
    + ", "
    + owner_stale_reason_sql(
        company="%(company)s::uuid", issue="%(issue)s::uuid", run="%(run)s::uuid"
    )
)


def preconditions(
    *,
    company_id: UUID,
    execution_workspace_id: UUID,
    owner: RuntimeLeaseOwner,
    judge_owner: bool = False,
) -> StaleReason | None:
    """Bound lock waits for the rest of the transaction and check, in one round trip, that
    the workspace, issue and run are the company's and the run is the owner agent's.

    Another company's (or no) workspace, issue or run is a 404; a run of another agent of
    the same company is a 403. With `judge_owner`, the same statement also judges the owner
    itself and returns the stale reason a lease it held would have (None: eligible,
    docs/leases.md#owner-eligibility); without, it returns None.
    """
    require_transaction()
    with connection.cursor() as cursor:
        cursor.execute(
            _PRECONDITIONS_JUDGING_OWNER_SQL if judge_owner else _PRECONDITIONS_SQL,
            {
                "timeout": locking.HOT_PATH_LOCK_TIMEOUT,  # read per call: tests shorten it
                "workspace": execution_workspace_id,
                "company": company_id,
                "issue": owner.issue_id,
                "run": owner.run_id,
            },
        )
        row = cursor.fetchone()
    assert row is not None  # noqa: S101 - a SELECT without FROM returns exactly one row
    _, workspace_found, issue_found, run_agent_id = row[:4]
    if not workspace_found:
        raise ExecutionWorkspaceNotFound(execution_workspace_id=str(execution_workspace_id))
    if owner.issue_id is not None and not issue_found:
        raise OwnerIssueNotFound(issue_id=str(owner.issue_id))
    if owner.run_id is not None:
        if run_agent_id is None:
            raise OwnerRunNotFound(run_id=str(owner.run_id))
        if owner.agent_id is not None and run_agent_id != owner.agent_id:
            raise OwnerRunForeign(run_id=str(owner.run_id))
    return cast("StaleReason | None", row[4]) if judge_owner else None


def audit(
    *,
    owner_actor: tuple[str, str],
    company_id: UUID,
    execution_workspace_id: UUID,
    action: str,
    run_id: UUID | None,
    details: dict[str, Any],
) -> None:
    activity_record(
        company_id=company_id,
        actor_type=owner_actor[0],
        actor_id=owner_actor[1],
        action=action,
        entity_type=ENTITY_TYPE,
        entity_id=execution_workspace_id,
        run_id=run_id,
        details=details,
    )


def lease_details(lease: RuntimeLease) -> dict[str, Any]:
    return {
        "lease_id": str(lease.id),
        "owner_key": lease.owner_key,
        "generation": lease.generation,
        "last_action": lease.last_action,
        "expires_at": iso(lease.expires_at),
    }


def fetch_lease(sql: str, params: list[Any]) -> RuntimeLease | None:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
    return None if row is None else RuntimeLease.from_row(row)
