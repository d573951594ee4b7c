"""Renew many controller leases of one agent in one statement (docs/leases.md#batch-renew).

An item renews exactly when `controller_lease_acquire` with the same `lease_owner` would renew:
the run is the agent's native run (of its company), not terminal, and its coordinator holds an
unexpired lease for that owner on the same boot. Then the expiry moves to the database clock
+ TTL, the generation stays, and no audit row is written. Nothing else: an item never mints or
takes over a lease (an expired or missing one is `controller_lease_held`, like someone
else's: acquire it on the single endpoint).

One UPDATE for every item, its own implicit transaction, answering each renewed lease's JSON
as PostgreSQL renders it from the row. The coordinator rows are locked first, in run-id order
(a sorted `FOR NO KEY UPDATE` read), so two batches never deadlock, and the expiry is sampled
after the lock (`clock_timestamp()`). Items not renewed are answered one by
one, read-only, by the single endpoint's checks in its order.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Final
from uuid import UUID

from django.db import connection, transaction

from checkpoints.errors import ControllerLeaseHeld, ControllerLeaseRunTerminal
from checkpoints.selectors import runner_run_get
from checkpoints.services.controller_lease import CONTROLLER_LEASE_TTL_DEFAULT
from paperclip.db import locking
from paperclip.db.locking import busy_on_lock_timeout
from paperclip.db.prepared import prepared_cursor
from paperclip.db.sql import iso_json_sql, json_object_sql
from paperclip.errors import DomainError, NotFoundError, PermissionDenied, ResourceBusy
from paperclip.models import HeartbeatRun, NativeRunFinalization
from paperclip.observability import metrics

MAX_ITEMS: Final = 500
_TABLE: Final = NativeRunFinalization._meta.db_table
_TERMINAL: Final = ", ".join(f"'{status}'" for status in sorted(HeartbeatRun.TERMINAL_STATUSES))


# The code stays `controller_lease_held` (what the single endpoint refuses a stale owner with);
# the words say that only an acquire can help.
_NOT_HELD: Final = (
    "No controller holds an unexpired lease on this run: a renew cannot bring one back. "
    "Acquire it anew (POST /api/heartbeat-runs/{run_id}/controller-lease without lease_owner)."
)


@dataclass(frozen=True, slots=True)
class ControllerRenewItem:
    run_id: UUID
    boot_id: str
    lease_owner: str
    ttl_seconds: int = CONTROLLER_LEASE_TTL_DEFAULT


# As the runtime kind's statement (leases/services/batch_renew.py): the batch as one JSON
# parameter (`n` the item's index), the coordinator rows locked in run-id order first, each
# renewed row answering its index and the lease's JSON as the single endpoint's
# OutputSerializer renders a renew (CONTROLLER_JSON_KEYS), built by PostgreSQL from the row.
CONTROLLER_JSON_KEYS: Final = (
    ("lease_owner", "f.lease_owner"),
    ("controller_boot_id", "f.controller_boot_id"),
    ("generation", "f.controller_generation"),
    ("lease_expires_at", iso_json_sql("f.lease_expires_at")),
    ("outcome", "'renewed'"),
)
_RENEW_SQL: Final = (
    "WITH v AS MATERIALIZED (SELECT b.n, b.r AS v_run, b.b AS v_boot, b.o AS v_owner,"  # noqa: S608
    " b.t AS v_ttl FROM json_to_recordset(%(items)s::json) AS b(n int, r uuid, b text, o text,"
    " t int) WHERE set_config('lock_timeout', %(timeout)s, true) IS NOT NULL),"
    " locked AS MATERIALIZED (SELECT f.run_id AS locked_run"
    f" FROM {_TABLE} f JOIN v ON f.run_id = v.v_run WHERE f.company_id = %(company)s"
    " ORDER BY f.run_id FOR NO KEY UPDATE OF f)"
    f" UPDATE {_TABLE} f SET lease_expires_at = clock_timestamp()"
    " + make_interval(secs => v.v_ttl), updated_at = now()"
    " FROM locked, v"
    " WHERE f.run_id = locked.locked_run AND f.run_id = v.v_run AND f.company_id = %(company)s"
    " AND f.lease_owner = v.v_owner AND f.controller_boot_id = v.v_boot"
    " AND f.lease_expires_at > clock_timestamp()"
    " AND EXISTS (SELECT 1 FROM heartbeat_runs r WHERE r.id = f.run_id"
    " AND r.company_id = %(company)s AND r.agent_id = %(agent)s"
    f" AND r.runtime_mode = '{HeartbeatRun.RuntimeMode.NATIVE}'"
    f" AND r.native_issue_id IS NOT NULL AND r.status NOT IN ({_TERMINAL}))"
    f" RETURNING v.n, {json_object_sql(list(CONTROLLER_JSON_KEYS))}"
)


def _batch_json(items: Sequence[ControllerRenewItem]) -> str:
    return json.dumps(
        [
            {
                "n": index,
                "r": str(item.run_id),
                "b": item.boot_id,
                "o": item.lease_owner,
                "t": item.ttl_seconds,
            }
            for index, item in enumerate(items)
        ],
        separators=(",", ":"),
    )


def controller_leases_renew(
    *, company_id: UUID, agent_id: UUID, items: Sequence[ControllerRenewItem]
) -> list[str | DomainError]:
    """Renew the agent's controller leases `items` (at most MAX_ITEMS, each run once): per
    item, in order, the renewed lease's JSON (text: the single endpoint's answer to a renew,
    outcome `renewed`, rendered by PostgreSQL from the row) or the error the single endpoint
    would give (NotFoundError for no run or another company's, PermissionDenied for another
    agent's, ControllerLeaseRunNotNative, ControllerLeaseRunTerminal, ControllerLeaseHeld
    for any lease this owner does not hold unexpired; ResourceBusy for every item when a row
    stayed locked past the lock timeout). Writes no audit row.

    Locks: the named coordinator rows, in run-id order (one statement, its own transaction).
    """
    if len(items) > MAX_ITEMS:
        raise ValueError(f"at most {MAX_ITEMS} items")
    if connection.in_atomic_block and not getattr(
        connection.atomic_blocks[-1], "_from_testcase", False
    ):
        raise RuntimeError("controller_leases_renew() must not run inside another transaction")
    if not items:
        return []
    try:
        with (
            busy_on_lock_timeout(resource="native_run_finalization"),
            prepared_cursor() as cursor,
        ):
            cursor.execute(
                _RENEW_SQL,
                {
                    "timeout": locking.HOT_PATH_LOCK_TIMEOUT,
                    "company": company_id,
                    "agent": agent_id,
                    "items": _batch_json(items),
                },
            )
            rows = cursor.fetchall()
    except DomainError as busy:
        return [busy] * len(items)
    answers: list[str | DomainError | None] = [None] * len(items)
    for index, lease_json in rows:
        answers[index] = lease_json
    if rows:
        metrics.CONTROLLER_LEASES.labels("renewed").inc(len(rows))
    return [
        _refusal(company_id=company_id, agent_id=agent_id, item=item) if answer is None else answer
        for item, answer in zip(items, answers, strict=True)
    ]


def _refusal(*, company_id: UUID, agent_id: UUID, item: ControllerRenewItem) -> DomainError:
    """Why the statement did not renew `item`: the single endpoint's checks in its order (the
    run visible to the agent, its own, native; then not terminal; then the lease), read in
    one short transaction that locks and writes nothing."""
    try:
        with transaction.atomic(durable=True):
            run_company = (
                HeartbeatRun.objects.filter(pk=item.run_id)
                .values_list("company_id", flat=True)
                .first()
            )
            if run_company != company_id:  # no such run, or another company's: alike
                raise NotFoundError()
            runner_run_get(run_id=item.run_id, agent_id=agent_id)
            status = (
                HeartbeatRun.objects.filter(pk=item.run_id).values_list("status", flat=True).get()
            )
            if status in HeartbeatRun.TERMINAL_STATUSES:
                raise ControllerLeaseRunTerminal(run_id=str(item.run_id), status=status)
            current = (
                NativeRunFinalization.objects.filter(pk=item.run_id)
                .values_list(
                    "lease_owner", "controller_boot_id", "controller_generation", "lease_expires_at"
                )
                .first()
            )
            owner, boot, generation, expires_at = current or (None, None, 0, None)
            active = owner is not None and _active(expires_at)
            if not active or owner != item.lease_owner or boot != item.boot_id:
                raise ControllerLeaseHeld(
                    None if active else _NOT_HELD,
                    controller_boot_id=boot,
                    generation=generation,
                    lease_expires_at=expires_at.isoformat() if expires_at else None,
                )
    except PermissionDenied:
        # The single endpoint's own words for another agent's run (checkpoints/api/views.py).
        return PermissionDenied("Only the run's own agent may use its checkpoint.")
    except DomainError as refused:
        return refused
    # Every check passes now: the lease changed between the statement and this read.
    return ResourceBusy("The controller lease changed while it was renewed; retry.")


def _active(expires_at: datetime | None) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT %s::timestamptz > clock_timestamp()", [expires_at])
        row = cursor.fetchone()
    return bool(row and row[0])
