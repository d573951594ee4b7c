"""Renew many runtime leases of one agent in one statement (docs/leases.md#batch-renew).

Each item names the lease it holds: the workspace, the owner (issue, run or the agent itself:
the claim's owner key), the `generation` it was granted and, optionally, the grant's `fence`.
It renews exactly when the claim's renew would for the same caller and the lease is still at
that generation (and fence): the owner key holds it (an expired lease nobody has reclaimed
still counts), the owner's issue or run is still eligible, a named run is the agent's. Nothing
else: an item never creates or reclaims a lease. A renew keeps `last_action`, `claimed_at`
and `generation`, moves `renewed_at` / `expires_at`, and writes no audit row.

One UPDATE for every item, its own implicit transaction like the claim's fast path, answering
each renewed item's lease JSON as PostgreSQL renders it from the row (no per-item object or
rendering in Python). The rows are locked first, in workspace-id order, by a `FOR NO KEY
UPDATE` read sorted on that key, so two batches naming the same leases in any order queue
behind each other instead of deadlocking. Items the statement did not renew are then
answered one by one, read-only, by the checks the claim makes in the same order (404
workspace, issue or run; 403 another agent's run; the owner ineligible; the lease
superseded), so a refused item fails alone and its neighbours are renewed all the same.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final
from uuid import UUID

from django.conf import settings
from django.db import connection, transaction

from leases.errors import RuntimeLeaseContended, RuntimeLeaseOwnerIneligible
from leases.selectors import LEASE_COLUMNS, LEASE_TABLE, lease_json_sql, owner_stale_reason_sql
from leases.services.operations import require_fence
from leases.services.shared import fetch_lease, preconditions
from leases.services.types import BUSY_MESSAGE, RuntimeLeaseOwner
from paperclip.db import locking
from paperclip.db.locking import busy_on_lock_timeout
from paperclip.db.prepared import prepared_cursor
from paperclip.errors import DomainError
from paperclip.observability import metrics

MAX_ITEMS: Final = 500


@dataclass(frozen=True, slots=True)
class RuntimeRenewItem:
    execution_workspace_id: UUID
    generation: int
    issue_id: UUID | None = None
    run_id: UUID | None = None
    fence: int | None = None
    ttl_seconds: int | None = None  # None: PAPERCLIP_RUNTIME_LEASE_TTL_SECONDS


# The batch travels as one JSON parameter, read by `json_to_recordset`: one statement text
# whatever the number of items, so it is prepared once per session (paperclip.db.prepared),
# and no per-item adaptation in Python. `v` is the batch (`n` the item's index, `k` its owner
# key, as RuntimeLeaseOwner.owner_key builds it); `locked` takes the row locks in workspace
# order before the UPDATE touches a row (its rows are all read before the join can emit one);
# the UPDATE's conditions are the claim's fast renew's, per row, plus the generation and
# fence. Each renewed row answers its index and its lease's JSON, rendered by PostgreSQL
# (leases.selectors.LEASE_JSON_KEYS). `set_config` bounds the lock waits of this statement,
# which is its own transaction.
_OWNER_STALE: Final = owner_stale_reason_sql(
    company="%(company)s::uuid", issue="v.v_issue", run="v.v_run"
)
_RENEW_SQL: Final = (
    "WITH v AS MATERIALIZED (SELECT b.n, b.w AS v_workspace, b.i AS v_issue, b.r AS v_run,"  # noqa: S608
    " COALESCE('issue:' || b.i, 'run:' || b.r, %(agent_key)s) AS v_key,"
    " b.g AS v_generation, b.f AS v_fence, b.t AS v_ttl"
    " FROM json_to_recordset(%(items)s::json)"
    " AS b(n int, w uuid, i uuid, r uuid, g bigint, f bigint, t int)"
    " WHERE set_config('lock_timeout', %(timeout)s, true) IS NOT NULL),"
    " locked AS MATERIALIZED (SELECT l.id AS locked_id"
    f" FROM {LEASE_TABLE} l JOIN v ON l.execution_workspace_id = v.v_workspace"
    " WHERE l.company_id = %(company)s ORDER BY l.execution_workspace_id"
    " FOR NO KEY UPDATE OF l)"
    f" UPDATE {LEASE_TABLE} l SET owner_issue_id = v.v_issue, owner_run_id = v.v_run,"
    " owner_agent_id = %(agent)s, renewed_at = now(),"
    " expires_at = now() + make_interval(secs => v.v_ttl), updated_at = now()"
    " FROM locked, v"
    " WHERE l.id = locked.locked_id AND l.execution_workspace_id = v.v_workspace"
    " AND l.company_id = %(company)s AND l.owner_key = v.v_key"
    " AND l.generation = v.v_generation AND (v.v_fence IS NULL OR l.fence = v.v_fence)"
    f" AND {_OWNER_STALE} IS NULL AND (v.v_run IS NULL OR EXISTS (SELECT 1 FROM heartbeat_runs r"
    " WHERE r.id = v.v_run AND r.company_id = %(company)s AND r.agent_id = %(agent)s))"
    f" RETURNING v.n, {lease_json_sql('l')}"
)

_CURRENT_SQL: Final = (
    f"SELECT {LEASE_COLUMNS} FROM {LEASE_TABLE}"  # noqa: S608
    " WHERE execution_workspace_id = %s AND company_id = %s"
)


def _uuid_or_none(value: UUID | None) -> str | None:
    return None if value is None else str(value)


def _batch_json(items: Sequence[RuntimeRenewItem], default_ttl: int) -> str:
    return json.dumps(
        [
            {
                "n": index,
                "w": str(item.execution_workspace_id),
                "i": _uuid_or_none(item.issue_id),
                "r": _uuid_or_none(item.run_id),
                "g": item.generation,
                "f": item.fence,
                "t": item.ttl_seconds or default_ttl,
            }
            for index, item in enumerate(items)
        ],
        separators=(",", ":"),
    )


def runtime_leases_renew(
    *, company_id: UUID, agent_id: UUID, items: Sequence[RuntimeRenewItem]
) -> list[str | DomainError]:
    """Renew the agent's runtime leases `items` (at most MAX_ITEMS, each workspace once):
    per item, in order, the renewed lease's JSON (text: the API's Lease JSON, rendered by
    PostgreSQL from the row) or the error the claim would raise for it
    (ExecutionWorkspaceNotFound / OwnerIssueNotFound / OwnerRunNotFound, OwnerRunForeign,
    RuntimeLeaseOwnerIneligible, RuntimeLeaseSuperseded when the owner key does not hold the
    lease at that generation and fence, RuntimeLeaseContended when the world moved between
    the statement and the check; ResourceBusy for every item when a row stayed locked past
    the lock timeout). Writes no audit row.

    Locks: the named lease rows, in workspace-id order (one statement, its own transaction).
    """
    if len(items) > MAX_ITEMS:
        raise ValueError(f"at most {MAX_ITEMS} items")
    if connection.in_atomic_block and not getattr(
        connection.atomic_blocks[-1], "_from_testcase", False
    ):
        raise RuntimeError("runtime_leases_renew() must not run inside another transaction")
    if not items:
        return []
    default_ttl = int(settings.PAPERCLIP_RUNTIME_LEASE_TTL_SECONDS)
    try:
        with busy_on_lock_timeout(BUSY_MESSAGE), prepared_cursor() as cursor:
            cursor.execute(
                _RENEW_SQL,
                {
                    "timeout": locking.HOT_PATH_LOCK_TIMEOUT,
                    "company": company_id,
                    "agent": agent_id,
                    "agent_key": RuntimeLeaseOwner.for_agent(agent_id).owner_key,
                    "items": _batch_json(items, default_ttl),
                },
            )
            rows = cursor.fetchall()
    except DomainError as busy:  # one row held past the timeout: the statement did nothing
        return [busy] * len(items)
    answers: list[str | DomainError | None] = [None] * len(items)
    for index, lease_json in rows:
        answers[index] = lease_json
    if rows:
        metrics.RUNTIME_LEASE_CLAIMS.labels("renewed").inc(len(rows))
    return [
        _refusal(company_id=company_id, item=item, owner=_owner(agent_id, item))
        if answer is None
        else answer
        for item, answer in zip(items, answers, strict=True)
    ]


def _owner(agent_id: UUID, item: RuntimeRenewItem) -> RuntimeLeaseOwner:
    return RuntimeLeaseOwner.for_agent(agent_id, run_id=item.run_id, issue_id=item.issue_id)


def _refusal(*, company_id: UUID, item: RuntimeRenewItem, owner: RuntimeLeaseOwner) -> DomainError:
    """Why the statement did not renew `item`: the claim's own checks, in its order, read in
    one short transaction that locks and writes nothing."""
    workspace_id = item.execution_workspace_id
    try:
        with busy_on_lock_timeout(BUSY_MESSAGE), transaction.atomic(durable=True):
            ineligible = preconditions(
                company_id=company_id,
                execution_workspace_id=workspace_id,
                owner=owner,
                judge_owner=True,
            )
            if ineligible is not None:
                raise RuntimeLeaseOwnerIneligible(
                    execution_workspace_id=str(workspace_id),
                    owner_key=owner.owner_key,
                    reason=ineligible,
                )
            current = fetch_lease(_CURRENT_SQL, [workspace_id, company_id])
            require_fence(
                execution_workspace_id=workspace_id,
                owner_key=owner.owner_key,
                generation=item.generation,
                current=current,
                ineligible=None,
                fence=item.fence,
            )
    except DomainError as refused:
        return refused
    # Every check passes now: the lease or its owner changed between the statement and this
    # read (an owner's issue reopened, say). Nothing was renewed; a retry decides.
    return RuntimeLeaseContended(execution_workspace_id=str(workspace_id), requested_action="renew")
