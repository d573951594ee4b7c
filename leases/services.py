"""Runtime leases: one exclusive, renewable lane per execution workspace (docs/leases.md).

An agent claims the lane before a runtime action (start/stop/restart/repair). The same owner
renews; anyone else gets `workspace_runtime_lease_conflict` until the holder turns stale
(lease expired, owner issue missing/hidden/terminal, owner run missing/terminal), when the
lane is reclaimed in place. Board actors bypass the lease. Release deletes the row.

Beyond upstream, every create and reclaim hands out a new `generation` from the workspace's
`runtime_lease_generation` counter; it never repeats for a workspace (the counter outlives
the lease row), so it fences writes: `workspace_operation_create_fenced` accepts an operation
only from the owner key that holds the lease at the generation it names.

Cross-process exclusivity comes from PostgreSQL alone: the unique lease row per workspace,
row locks in a fixed order (see `leases.locks`), and database time (`now()`) for every TTL.
The renew hot path is one gated UPDATE running as its own implicit transaction; only a miss
takes the slow path (one short durable transaction under the workspace row lock). The claim
round trips are raw SQL because this is the hottest write in the system (see bench/leases.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final, Literal
from uuid import UUID, uuid4

from django.conf import settings
from django.db import IntegrityError, connection, transaction

from leases import locks
from leases.errors import (
    ExecutionWorkspaceNotFound,
    OwnerIssueNotFound,
    OwnerRunForeign,
    OwnerRunNotFound,
    RuntimeLeaseConflict,
    RuntimeLeaseContended,
    RuntimeLeaseSuperseded,
)
from leases.models import WorkspaceRuntimeLease
from leases.selectors import (
    LEASE_COLUMNS,
    LEASE_TABLE,
    STALE,
    STALE_REASON,
    STALE_REASONS,
    RuntimeLease,
    RuntimeLeaseView,
    StaleReason,
    runtime_lease_evaluate_stale,
    runtime_lease_get,
    runtime_lease_stale_page,
    with_stale_reason,
)
from paperclip.activity import activity_record
from paperclip.db import locking
from paperclip.db.locking import busy_on_lock_timeout, require_transaction
from paperclip.errors import InvalidRequest
from paperclip.models import WorkspaceOperation

__all__ = [
    "LEASED_ACTIONS",
    "STALE_REASONS",
    "TTL_MAX_SECONDS",
    "TTL_MIN_SECONDS",
    "ReclaimedFrom",
    "RuntimeLease",
    "RuntimeLeaseClaim",
    "RuntimeLeaseOwner",
    "RuntimeLeaseRelease",
    "RuntimeLeaseSweepBatch",
    "RuntimeLeaseSweepReport",
    "RuntimeLeaseView",
    "WorkspaceOperationRecord",
    "runtime_lease_claim",
    "runtime_lease_evaluate_stale",
    "runtime_lease_force_release",
    "runtime_lease_get",
    "runtime_lease_release",
    "runtime_lease_sweep",
    "runtime_lease_sweep_batch",
    "workspace_operation_create_fenced",
]

LEASED_ACTIONS: Final[tuple[str, ...]] = tuple(WorkspaceRuntimeLease.Action.values)
TTL_MIN_SECONDS: Final = 60
TTL_MAX_SECONDS: Final = 86_400
BUSY_MESSAGE: Final = "The runtime lease is locked by another request; retry shortly."
SWEEP_ACTOR_ID: Final = "sweep_runtime_leases"
ENTITY_TYPE: Final = "execution_workspace"

ClaimOutcome = Literal["created", "renewed", "reclaimed", "bypassed"]


# --- value types --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RuntimeLeaseOwner:
    """Who claims: the audit actor plus the ids the owner key is derived from."""

    actor_type: Literal["agent", "user", "system"]
    actor_id: str
    agent_id: UUID | None = None
    run_id: UUID | None = None
    issue_id: UUID | None = None

    @classmethod
    def for_agent(
        cls, agent_id: UUID, *, run_id: UUID | None = None, issue_id: UUID | None = None
    ) -> RuntimeLeaseOwner:
        return cls("agent", str(agent_id), agent_id=agent_id, run_id=run_id, issue_id=issue_id)

    @classmethod
    def for_board(cls, user_id: Any) -> RuntimeLeaseOwner:
        return cls("user", str(user_id))

    @property
    def owner_key(self) -> str | None:
        """`issue:<id>`, else `run:<id>`, else `agent:<id>`: the issue outlives any single run,
        so it is the most durable identity in scope (docs/leases.md#owner-key)."""
        if self.issue_id is not None:
            return f"issue:{self.issue_id}"
        if self.run_id is not None:
            return f"run:{self.run_id}"
        if self.agent_id is not None:
            return f"agent:{self.agent_id}"
        return None


@dataclass(frozen=True, slots=True)
class ReclaimedFrom:
    owner_key: str
    reason: StaleReason


@dataclass(frozen=True, slots=True)
class RuntimeLeaseClaim:
    outcome: ClaimOutcome
    owner_key: str | None
    lease: RuntimeLease | None
    reclaimed_from: ReclaimedFrom | None = None


@dataclass(frozen=True, slots=True)
class RuntimeLeaseRelease:
    released: bool
    owner_key: str | None
    lease: RuntimeLease | None = None  # the deleted row, when one was deleted


@dataclass(frozen=True, slots=True)
class WorkspaceOperationRecord:
    id: UUID
    company_id: UUID
    execution_workspace_id: UUID
    heartbeat_run_id: UUID | None
    issue_id: UUID | None
    actor_agent_id: UUID | None
    phase: str
    command: str | None
    status: str
    exit_code: int | None
    lease_generation: int
    started_at: datetime
    finished_at: datetime | None


@dataclass(frozen=True, slots=True)
class RuntimeLeaseSweepBatch:
    examined: int  # candidates handed in
    skipped_locked: int  # held by a concurrent claim/release right now
    survived: int  # locked, but no longer stale on re-check (renewed or reclaimed meanwhile)
    deleted: tuple[tuple[UUID, StaleReason], ...]


@dataclass(slots=True)
class RuntimeLeaseSweepReport:
    dry_run: bool
    batches: int = 0
    examined: int = 0
    skipped_locked: int = 0
    survived: int = 0
    by_reason: Counter[str] = field(default_factory=Counter)

    @property
    def deleted(self) -> int:
        return sum(self.by_reason.values())


# --- helpers ------------------------------------------------------------------------------


def _iso(value: datetime) -> str:
    """ISO-8601 in UTC with `Z`, the same text DRF renders for the lease's datetimes."""
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _str_or_none(value: UUID | None) -> str | None:
    return None if value is None else str(value)


def _require_action(action: str) -> str:
    if action not in LEASED_ACTIONS:
        raise InvalidRequest(
            fields={"action": [f"Must be one of: {', '.join(LEASED_ACTIONS)}."]},
        )
    return action


def _ttl_seconds(ttl_seconds: int | None) -> int:
    if ttl_seconds is None:
        return int(settings.PAPERCLIP_RUNTIME_LEASE_TTL_SECONDS)
    if (
        isinstance(ttl_seconds, bool)
        or not isinstance(ttl_seconds, int)
        or not TTL_MIN_SECONDS <= ttl_seconds <= TTL_MAX_SECONDS
    ):
        raise InvalidRequest(
            fields={
                "ttl_seconds": [f"Must be an integer from {TTL_MIN_SECONDS} to {TTL_MAX_SECONDS}."]
            },
        )
    return ttl_seconds


def _preconditions(
    *, company_id: UUID, execution_workspace_id: UUID, owner: RuntimeLeaseOwner
) -> None:
    """Bound lock waits for the rest of the transaction and check, in one round trip, that
    the workspace, issue and run are the company's and the run is the owner agent's.

    Another company's (or no) workspace, issue or run is a 404; a run of another agent of
    the same company is a 403.
    """
    require_transaction()
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT set_config('lock_timeout', %s, true),"
            " EXISTS (SELECT 1 FROM execution_workspaces WHERE id = %s AND company_id = %s),"
            " EXISTS (SELECT 1 FROM issues WHERE id = %s AND company_id = %s),"
            " (SELECT agent_id FROM heartbeat_runs WHERE id = %s AND company_id = %s)",
            [
                locking.HOT_PATH_LOCK_TIMEOUT,  # read per call: tests shorten it
                execution_workspace_id,
                company_id,
                owner.issue_id,
                company_id,
                owner.run_id,
                company_id,
            ],
        )
        row = cursor.fetchone()
    assert row is not None  # noqa: S101 - a SELECT without FROM returns exactly one row
    _, workspace_found, issue_found, run_agent_id = row
    if not workspace_found:
        raise ExecutionWorkspaceNotFound(execution_workspace_id=str(execution_workspace_id))
    if owner.issue_id is not None and not issue_found:
        raise OwnerIssueNotFound(issue_id=str(owner.issue_id))
    if owner.run_id is not None:
        if run_agent_id is None:
            raise OwnerRunNotFound(run_id=str(owner.run_id))
        if owner.agent_id is not None and run_agent_id != owner.agent_id:
            raise OwnerRunForeign(run_id=str(owner.run_id))


def _audit(
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


def _lease_details(lease: RuntimeLease) -> dict[str, Any]:
    return {
        "lease_id": str(lease.id),
        "owner_key": lease.owner_key,
        "generation": lease.generation,
        "last_action": lease.last_action,
        "expires_at": _iso(lease.expires_at),
    }


def _conflict(
    lease: RuntimeLease, *, requested_action: str, requested_owner_key: str
) -> RuntimeLeaseConflict:
    return RuntimeLeaseConflict(
        execution_workspace_id=str(lease.execution_workspace_id),
        requested_action=requested_action,
        requested_owner_key=requested_owner_key,
        owner_key=lease.owner_key,
        owner_issue_id=_str_or_none(lease.owner_issue_id),
        owner_run_id=_str_or_none(lease.owner_run_id),
        owner_agent_id=_str_or_none(lease.owner_agent_id),
        last_action=lease.last_action,
        claimed_at=_iso(lease.claimed_at),
        renewed_at=_iso(lease.renewed_at),
        expires_at=_iso(lease.expires_at),
        generation=lease.generation,
    )


def _fetch_lease(sql: str, params: list[Any]) -> RuntimeLease | None:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
    return None if row is None else RuntimeLease.from_row(row)


# Renew touches only the lease row: no workspace lock, no counter, no audit (docs/leases.md#audit:
# renews are not audited). `claimed_at` and `generation` stay; owner columns may change (new run).
_RENEW_SQL: Final = (
    f"UPDATE {LEASE_TABLE} SET owner_issue_id = %s, owner_run_id = %s, owner_agent_id = %s,"  # noqa: S608
    " last_action = %s, renewed_at = now(), expires_at = now() + make_interval(secs => %s),"
    " updated_at = now()"
    " WHERE execution_workspace_id = %s"
    " AND (company_id, owner_key) IS NOT DISTINCT FROM (%s::uuid, %s::text)"
    f" RETURNING {LEASE_COLUMNS}"
)

# The hot path in one statement, its own implicit transaction: renew if the caller already
# holds the lease and its issue/run are (still) valid for it. A miss changes nothing and
# falls through to the slow path, which names the failed precondition or creates, reclaims
# or refuses. `set_config` sits in the WHERE clause because the quals are evaluated before
# the UPDATE waits for the row lock, so the lock timeout applies to that wait. (A lease row
# exists only for a workspace of its company, so the workspace needs no separate check.)
# Only the unique workspace key is indexable (IS NOT DISTINCT FROM is not): with stale
# statistics the planner would otherwise pick the (company_id, owner_key) index and walk
# every lease of an agent that holds many (measured: 3x slower renews at 3,000 leases).
_FAST_RENEW_SQL: Final = (
    f"UPDATE {LEASE_TABLE} SET owner_issue_id = %(issue)s, owner_run_id = %(run)s,"  # noqa: S608
    " owner_agent_id = %(agent)s, last_action = %(action)s, renewed_at = now(),"
    " expires_at = now() + make_interval(secs => %(ttl)s), updated_at = now()"
    " WHERE execution_workspace_id = %(workspace)s"
    " AND (company_id, owner_key) IS NOT DISTINCT FROM (%(company)s::uuid, %(owner_key)s::text)"
    " AND set_config('lock_timeout', %(timeout)s, true) IS NOT NULL"
    " AND (%(issue)s::uuid IS NULL OR EXISTS (SELECT 1 FROM issues"
    "  WHERE id = %(issue)s AND company_id = %(company)s))"
    " AND (%(run)s::uuid IS NULL OR EXISTS (SELECT 1 FROM heartbeat_runs"
    "  WHERE id = %(run)s AND company_id = %(company)s AND agent_id = %(agent)s))"
    f" RETURNING {LEASE_COLUMNS}"
)

# Insert and counter bump in one statement, under the workspace row lock already held.
_CREATE_SQL: Final = (
    f"WITH created AS (INSERT INTO {LEASE_TABLE} (id, company_id, execution_workspace_id,"  # noqa: S608
    " owner_key, owner_issue_id, owner_run_id, owner_agent_id, last_action, generation,"
    " claimed_at, renewed_at, expires_at, metadata, created_at, updated_at)"
    " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, now(), now(),"
    " now() + make_interval(secs => %s), NULL, now(), now())"
    f" ON CONFLICT (execution_workspace_id) DO NOTHING RETURNING {LEASE_COLUMNS}),"
    " bumped AS (UPDATE execution_workspaces w SET runtime_lease_generation = c.generation"
    " FROM created c WHERE w.id = c.execution_workspace_id)"
    f" SELECT {LEASE_COLUMNS} FROM created"
)

_RECLAIM_SQL: Final = (
    f"WITH reclaimed AS (UPDATE {LEASE_TABLE} SET owner_key = %s, owner_issue_id = %s,"  # noqa: S608
    " owner_run_id = %s, owner_agent_id = %s, last_action = %s, generation = %s,"
    " claimed_at = now(), renewed_at = now(), expires_at = now() + make_interval(secs => %s),"
    " metadata = jsonb_build_object('reclaimedFromOwnerKey', %s::text, 'reclaimReason',"
    " %s::text, 'reclaimedAt',"
    """ to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')),"""
    f" updated_at = now() WHERE id = %s RETURNING {LEASE_COLUMNS}),"
    " bumped AS (UPDATE execution_workspaces w SET runtime_lease_generation = r.generation"
    " FROM reclaimed r WHERE w.id = r.execution_workspace_id)"
    f" SELECT {LEASE_COLUMNS} FROM reclaimed"
)


# --- claim --------------------------------------------------------------------------------


def runtime_lease_claim(
    *,
    company_id: UUID,
    execution_workspace_id: UUID,
    action: str,
    owner: RuntimeLeaseOwner,
    ttl_seconds: int | None = None,
) -> RuntimeLeaseClaim:
    """Claim, renew or reclaim the workspace's runtime lease for `owner`.

    Board (`user`/`system`) actors and owners without any id are `bypassed`: they never take
    or block the lane. For an agent: the same owner key renews (claimed_at and generation
    unchanged); no lease creates one with the next generation; a stale holder is reclaimed
    in place with the next generation and `{reclaimedFromOwnerKey, reclaimReason,
    reclaimedAt}` metadata; a live holder is refused and left untouched.

    Locks: the renew fast path locks only the lease row (one UPDATE). Otherwise the
    workspace row (FOR NO KEY UPDATE), then the lease row (FOR UPDATE); `lock_timeout` 5s.
    Raises InvalidRequest (action, ttl), ExecutionWorkspaceNotFound / OwnerIssueNotFound /
    OwnerRunNotFound (404), OwnerRunForeign (403), RuntimeLeaseConflict,
    RuntimeLeaseContended, ResourceBusy (409). Audits created, reclaimed and bypassed claims.
    """
    action = _require_action(action)
    ttl = _ttl_seconds(ttl_seconds)
    owner_key = owner.owner_key
    if owner.actor_type != "agent" or owner_key is None:
        return _claim_bypass(
            company_id=company_id,
            execution_workspace_id=execution_workspace_id,
            action=action,
            owner=owner,
        )
    with busy_on_lock_timeout(BUSY_MESSAGE):
        try:
            renewed = _claim_fast_renew(
                company_id=company_id,
                execution_workspace_id=execution_workspace_id,
                action=action,
                owner=owner,
                owner_key=owner_key,
                ttl=ttl,
            )
            if renewed is not None:
                return RuntimeLeaseClaim(outcome="renewed", owner_key=owner_key, lease=renewed)
            with transaction.atomic(durable=True):
                _preconditions(
                    company_id=company_id,
                    execution_workspace_id=execution_workspace_id,
                    owner=owner,
                )
                return _claim_in_tx(
                    company_id=company_id,
                    execution_workspace_id=execution_workspace_id,
                    action=action,
                    owner=owner,
                    owner_key=owner_key,
                    ttl=ttl,
                )
        except IntegrityError as exc:
            # An owner issue/run deleted between our check and the FK check: the world moved
            # under the claim; a retry answers with the proper 404.
            raise RuntimeLeaseContended(
                execution_workspace_id=str(execution_workspace_id), requested_action=action
            ) from exc


def _claim_fast_renew(
    *,
    company_id: UUID,
    execution_workspace_id: UUID,
    action: str,
    owner: RuntimeLeaseOwner,
    owner_key: str,
    ttl: int,
) -> RuntimeLease | None:
    """Renew in one autocommit statement; None when it did not apply (no lease held by this
    owner key, or a precondition failed: the slow path sorts out which).

    Departs from "services own atomic(durable=True)" on purpose: a single statement is its
    own transaction, and BEGIN/COMMIT would add two round trips to the hottest write. The
    durable guarantee (never silently joining a caller's transaction) is kept by hand.
    """
    if connection.in_atomic_block and not getattr(
        connection.atomic_blocks[-1], "_from_testcase", False
    ):
        raise RuntimeError("runtime_lease_claim() must not run inside another transaction")
    with connection.cursor() as cursor:
        cursor.execute(
            _FAST_RENEW_SQL,
            {
                "timeout": locking.HOT_PATH_LOCK_TIMEOUT,
                "workspace": execution_workspace_id,
                "company": company_id,
                "issue": owner.issue_id,
                "run": owner.run_id,
                "agent": owner.agent_id,
                "action": action,
                "ttl": ttl,
                "owner_key": owner_key,
            },
        )
        row = cursor.fetchone()
    return None if row is None else RuntimeLease.from_row(row)


def _claim_bypass(
    *, company_id: UUID, execution_workspace_id: UUID, action: str, owner: RuntimeLeaseOwner
) -> RuntimeLeaseClaim:
    with transaction.atomic(durable=True):
        _preconditions(
            company_id=company_id, execution_workspace_id=execution_workspace_id, owner=owner
        )
        _audit(
            owner_actor=(owner.actor_type, owner.actor_id),
            company_id=company_id,
            execution_workspace_id=execution_workspace_id,
            action="runtime_lease.bypassed",
            run_id=owner.run_id,
            details={"requested_action": action},
        )
    return RuntimeLeaseClaim(outcome="bypassed", owner_key=None, lease=None)


def _claim_in_tx(
    *,
    company_id: UUID,
    execution_workspace_id: UUID,
    action: str,
    owner: RuntimeLeaseOwner,
    owner_key: str,
    ttl: int,
) -> RuntimeLeaseClaim:
    require_transaction()
    actor = (owner.actor_type, owner.actor_id)
    last_generation = locks.workspace_generation_for_update(
        company_id=company_id, execution_workspace_id=execution_workspace_id
    )
    if last_generation is None:
        raise ExecutionWorkspaceNotFound(execution_workspace_id=str(execution_workspace_id))
    next_generation = last_generation + 1

    created = _fetch_lease(
        _CREATE_SQL,
        [
            uuid4(),
            company_id,
            execution_workspace_id,
            owner_key,
            owner.issue_id,
            owner.run_id,
            owner.agent_id,
            action,
            next_generation,
            ttl,
        ],
    )
    if created is not None:
        _audit(
            owner_actor=actor,
            company_id=company_id,
            execution_workspace_id=execution_workspace_id,
            action="runtime_lease.created",
            run_id=owner.run_id,
            details=_lease_details(created),
        )
        return RuntimeLeaseClaim(outcome="created", owner_key=owner_key, lease=created)

    current = locks.runtime_lease_for_update(execution_workspace_id=execution_workspace_id)
    if current is None:
        # Released between our insert's conflict and the lock; the caller retries at once
        # rather than acting on a workspace it does not hold.
        raise RuntimeLeaseContended(
            execution_workspace_id=str(execution_workspace_id), requested_action=action
        )
    if current.owner_key == owner_key:
        # Created by the same owner between the fast path and the workspace lock.
        renewed = _fetch_lease(
            _RENEW_SQL,
            [
                owner.issue_id,
                owner.run_id,
                owner.agent_id,
                action,
                ttl,
                execution_workspace_id,
                company_id,
                owner_key,
            ],
        )
        return RuntimeLeaseClaim(outcome="renewed", owner_key=owner_key, lease=renewed)

    reason = runtime_lease_evaluate_stale(lease_id=current.id)
    if reason is None:
        raise _conflict(current, requested_action=action, requested_owner_key=owner_key)

    reclaimed = _fetch_lease(
        _RECLAIM_SQL,
        [
            owner_key,
            owner.issue_id,
            owner.run_id,
            owner.agent_id,
            action,
            next_generation,
            ttl,
            current.owner_key,
            reason,
            current.id,
        ],
    )
    assert reclaimed is not None  # noqa: S101 - the row is locked by this transaction
    _audit(
        owner_actor=actor,
        company_id=company_id,
        execution_workspace_id=execution_workspace_id,
        action="runtime_lease.reclaimed",
        run_id=owner.run_id,
        details={
            **_lease_details(reclaimed),
            "reclaimed_from_owner_key": current.owner_key,
            "reclaimed_from_generation": current.generation,
            "reason": reason,
        },
    )
    return RuntimeLeaseClaim(
        outcome="reclaimed",
        owner_key=owner_key,
        lease=reclaimed,
        reclaimed_from=ReclaimedFrom(owner_key=current.owner_key, reason=reason),
    )


# --- release ------------------------------------------------------------------------------

_DELETE_OWNED_SQL: Final = (
    f"DELETE FROM {LEASE_TABLE} WHERE execution_workspace_id = %s"  # noqa: S608
    " AND (company_id, owner_key) IS NOT DISTINCT FROM (%s::uuid, %s::text)"
    f" RETURNING {LEASE_COLUMNS}"
)
_DELETE_ANY_SQL: Final = (
    f"DELETE FROM {LEASE_TABLE} WHERE execution_workspace_id = %s AND company_id = %s"  # noqa: S608
    " AND (%s::bigint IS NULL OR generation = %s::bigint)"
    f" RETURNING {LEASE_COLUMNS}"
)


def runtime_lease_release(
    *, company_id: UUID, execution_workspace_id: UUID, owner: RuntimeLeaseOwner
) -> RuntimeLeaseRelease:
    """Delete the workspace's lease only if `owner`'s key holds it.

    Locks: the lease row (by the DELETE). An owner without any id releases nothing. Raises
    the same 404/403 errors as a claim for foreign ids, ResourceBusy. Audits a release.
    """
    owner_key = owner.owner_key
    with busy_on_lock_timeout(BUSY_MESSAGE), transaction.atomic(durable=True):
        _preconditions(
            company_id=company_id, execution_workspace_id=execution_workspace_id, owner=owner
        )
        if owner_key is None:
            return RuntimeLeaseRelease(released=False, owner_key=None)
        deleted = _fetch_lease(_DELETE_OWNED_SQL, [execution_workspace_id, company_id, owner_key])
        if deleted is None:
            return RuntimeLeaseRelease(released=False, owner_key=None)
        _audit(
            owner_actor=(owner.actor_type, owner.actor_id),
            company_id=company_id,
            execution_workspace_id=execution_workspace_id,
            action="runtime_lease.released",
            run_id=owner.run_id,
            details=_lease_details(deleted),
        )
    return RuntimeLeaseRelease(released=True, owner_key=deleted.owner_key, lease=deleted)


def runtime_lease_force_release(
    *,
    company_id: UUID,
    execution_workspace_id: UUID,
    actor_type: Literal["user", "system"],
    actor_id: str,
    reason: str,
    expected_generation: int | None = None,
) -> RuntimeLeaseRelease:
    """Operator release: delete whatever lease the workspace has (board/system callers only;
    the API and admin enforce that). `reason` (non-blank) is kept in the audit row.

    With `expected_generation` (the admin pins what the operator saw), a lease that was
    reclaimed or re-created since is left alone: RuntimeLeaseSuperseded.
    Locks: the lease row. Raises InvalidRequest, ExecutionWorkspaceNotFound, ResourceBusy.
    """
    reason = (reason or "").strip()
    if not reason:
        raise InvalidRequest(fields={"reason": ["A reason is required to force-release."]})
    owner = RuntimeLeaseOwner(actor_type, actor_id)
    with busy_on_lock_timeout(BUSY_MESSAGE), transaction.atomic(durable=True):
        _preconditions(
            company_id=company_id, execution_workspace_id=execution_workspace_id, owner=owner
        )
        deleted = _fetch_lease(
            _DELETE_ANY_SQL,
            [execution_workspace_id, company_id, expected_generation, expected_generation],
        )
        if deleted is None:
            if expected_generation is not None:
                current = runtime_lease_get(execution_workspace_id=execution_workspace_id)
                if current.lease is not None:
                    raise RuntimeLeaseSuperseded(
                        execution_workspace_id=str(execution_workspace_id),
                        requested_generation=expected_generation,
                        current_generation=current.lease.generation,
                    )
            return RuntimeLeaseRelease(released=False, owner_key=None)
        _audit(
            owner_actor=(actor_type, actor_id),
            company_id=company_id,
            execution_workspace_id=execution_workspace_id,
            action="runtime_lease.force_released",
            run_id=None,
            details={**_lease_details(deleted), "reason": reason},
        )
    return RuntimeLeaseRelease(released=True, owner_key=deleted.owner_key, lease=deleted)


# --- fenced operations --------------------------------------------------------------------

_OPERATION_INSERT_SQL: Final = (
    "INSERT INTO workspace_operations (id, company_id, execution_workspace_id, heartbeat_run_id,"
    " actor_agent_id, actor_run_id, issue_id, phase, command, status, exit_code,"
    " lease_generation, started_at, finished_at, created_at, updated_at)"
    " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, now(),"
    " CASE WHEN %s = 'running' THEN NULL ELSE now() END, now(), now())"
    " RETURNING started_at, finished_at"
)


def workspace_operation_create_fenced(
    *,
    company_id: UUID,
    execution_workspace_id: UUID,
    owner: RuntimeLeaseOwner,
    generation: int,
    phase: str,
    status: str,
    command: str | None = None,
    exit_code: int | None = None,
) -> WorkspaceOperationRecord:
    """Record a workspace operation only while `owner`'s key holds the lease at `generation`.

    An expired lease nobody has reclaimed still counts: expiry only lets others take over.
    Locks: the lease row FOR SHARE while inserting, so a reclaim waits for this write and a
    write after the reclaim sees the new generation. A refused write rolls back; its
    rejection is then audited in a separate small transaction (so the audit survives).
    Raises RuntimeLeaseSuperseded (409, `current_generation` null when no lease), the
    claim's 404/403 errors, InvalidRequest, ResourceBusy.
    """
    if status not in WorkspaceOperation.Status.values:
        raise InvalidRequest(
            fields={"status": [f"Must be one of: {', '.join(WorkspaceOperation.Status.values)}."]}
        )
    owner_key = owner.owner_key
    with busy_on_lock_timeout(BUSY_MESSAGE):
        try:
            with transaction.atomic(durable=True):
                _preconditions(
                    company_id=company_id,
                    execution_workspace_id=execution_workspace_id,
                    owner=owner,
                )
                current = locks.runtime_lease_for_share(
                    execution_workspace_id=execution_workspace_id
                )
                if (
                    owner_key is None
                    or current is None
                    or current.owner_key != owner_key
                    or current.generation != generation
                ):
                    raise RuntimeLeaseSuperseded(
                        execution_workspace_id=str(execution_workspace_id),
                        requested_owner_key=owner_key,
                        requested_generation=generation,
                        current_generation=None if current is None else current.generation,
                        owner_key=None if current is None else current.owner_key,
                    )
                operation_id = uuid4()
                with connection.cursor() as cursor:
                    cursor.execute(
                        _OPERATION_INSERT_SQL,
                        [
                            operation_id,
                            company_id,
                            execution_workspace_id,
                            owner.run_id,
                            owner.agent_id,
                            owner.run_id,
                            owner.issue_id,
                            phase,
                            command,
                            status,
                            exit_code,
                            generation,
                            status,
                        ],
                    )
                    inserted = cursor.fetchone()
                assert inserted is not None  # noqa: S101 - INSERT ... RETURNING of one row
                started_at, finished_at = inserted
                _audit(
                    owner_actor=(owner.actor_type, owner.actor_id),
                    company_id=company_id,
                    execution_workspace_id=execution_workspace_id,
                    action="workspace_operation.recorded",
                    run_id=owner.run_id,
                    details={
                        "operation_id": str(operation_id),
                        "phase": phase,
                        "status": status,
                        "lease_generation": generation,
                        "owner_key": owner_key,
                    },
                )
        except RuntimeLeaseSuperseded as exc:
            _record_superseded_write(
                company_id=company_id,
                execution_workspace_id=execution_workspace_id,
                owner=owner,
                phase=phase,
                details=exc.details,
            )
            raise
        except IntegrityError as exc:
            raise RuntimeLeaseContended(
                execution_workspace_id=str(execution_workspace_id), requested_action=phase
            ) from exc
    return WorkspaceOperationRecord(
        id=operation_id,
        company_id=company_id,
        execution_workspace_id=execution_workspace_id,
        heartbeat_run_id=owner.run_id,
        issue_id=owner.issue_id,
        actor_agent_id=owner.agent_id,
        phase=phase,
        command=command,
        status=status,
        exit_code=exit_code,
        lease_generation=generation,
        started_at=started_at,
        finished_at=finished_at,
    )


def _record_superseded_write(
    *,
    company_id: UUID,
    execution_workspace_id: UUID,
    owner: RuntimeLeaseOwner,
    phase: str,
    details: dict[str, Any],
) -> None:
    # The refused request's own transaction rolled back (a failed request changes nothing);
    # the evidence that a stale owner tried to act is still worth one audit row of its own.
    with transaction.atomic(durable=True):
        _audit(
            owner_actor=(owner.actor_type, owner.actor_id),
            company_id=company_id,
            execution_workspace_id=execution_workspace_id,
            action="runtime_lease.superseded_write_rejected",
            run_id=None,  # the run FK may be the reason the write failed; keep it in details
            details={**details, "phase": phase, "run_id": _str_or_none(owner.run_id)},
        )


# --- sweep --------------------------------------------------------------------------------


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
            _audit(
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
