"""Claim, renew or reclaim a workspace's runtime lease (docs/leases.md).

An agent claims the lane before a runtime action (start/stop/restart/repair). The same owner
renews; anyone else gets `workspace_runtime_lease_conflict` until the holder turns stale
(lease expired, owner issue missing/hidden/terminal, owner run missing/terminal), when the
lane is reclaimed in place. An agent whose own owner is stale by that same verdict gets
`workspace_runtime_lease_owner_ineligible` and neither creates, renews nor reclaims. Board
actors bypass the lease.

Every create and reclaim hands out a new `generation` from the workspace's
`runtime_lease_generation` counter; it never repeats for a workspace (the counter outlives
the lease row), so it fences writes (`leases.services.operations`).

The renew hot path is one gated UPDATE running as its own implicit transaction; only a miss
takes the slow path (one short durable transaction under the workspace row lock). The claim
round trips are raw SQL because this is the hottest write in the system (see bench/leases.py),
and the renew is a prepared statement.
"""

from __future__ import annotations

from typing import Final
from uuid import UUID, uuid4

from django.conf import settings
from django.db import IntegrityError, connection, transaction

from leases import locks
from leases.errors import (
    ExecutionWorkspaceNotFound,
    RuntimeLeaseConflict,
    RuntimeLeaseContended,
    RuntimeLeaseOwnerIneligible,
)
from leases.selectors import (
    LEASE_COLUMNS,
    LEASE_TABLE,
    RuntimeLease,
    owner_stale_reason_sql,
    runtime_lease_evaluate_stale,
)
from leases.services.shared import (
    audit,
    fetch_lease,
    iso,
    lease_details,
    preconditions,
    str_or_none,
)
from leases.services.types import (
    BUSY_MESSAGE,
    LEASED_ACTIONS,
    TTL_MAX_SECONDS,
    TTL_MIN_SECONDS,
    ReclaimedFrom,
    RuntimeLeaseClaim,
    RuntimeLeaseOwner,
)
from paperclip.db import locking
from paperclip.db.locking import busy_on_lock_timeout, require_transaction
from paperclip.db.prepared import prepared_fetchone
from paperclip.errors import InvalidRequest
from paperclip.observability import metrics


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


def _conflict(
    lease: RuntimeLease, *, requested_action: str, requested_owner_key: str
) -> RuntimeLeaseConflict:
    return RuntimeLeaseConflict(
        execution_workspace_id=str(lease.execution_workspace_id),
        requested_action=requested_action,
        requested_owner_key=requested_owner_key,
        owner_key=lease.owner_key,
        owner_issue_id=str_or_none(lease.owner_issue_id),
        owner_run_id=str_or_none(lease.owner_run_id),
        owner_agent_id=str_or_none(lease.owner_agent_id),
        last_action=lease.last_action,
        claimed_at=iso(lease.claimed_at),
        renewed_at=iso(lease.renewed_at),
        expires_at=iso(lease.expires_at),
        generation=lease.generation,
    )


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
# holds the lease, its issue/run are (still) valid for it and its own owner is still eligible
# (docs/leases.md#owner-eligibility). A miss changes nothing and falls through to the slow
# path, which names the failed precondition or the ineligible owner, or creates, reclaims or
# refuses. `set_config` sits in the WHERE clause because the quals are evaluated before the
# UPDATE waits for the row lock, so the lock timeout applies to that wait. (A lease row
# exists only for a workspace of its company, so the workspace needs no separate check; an
# eligible issue owner's issue is the company's, so the issue needs none either.)
# Only the unique workspace key is indexable (IS NOT DISTINCT FROM is not): with stale
# statistics the planner would otherwise pick the (company_id, owner_key) index and walk
# every lease of an agent that holds many (measured: 3x slower renews at 3,000 leases).
# One text per claimant shape (issue named?, run named?): each carries only the lookups its
# owner needs. Each is a prepared statement (paperclip.db.prepared): parsing and planning it
# afresh was most of PostgreSQL's work per renew (bench/renew_load.py).
def _fast_renew_sql(*, issue: bool, run: bool) -> str:
    conditions = [
        "execution_workspace_id = %(workspace)s",
        "(company_id, owner_key) IS NOT DISTINCT FROM (%(company)s::uuid, %(owner_key)s::text)",
        "set_config('lock_timeout', %(timeout)s, true) IS NOT NULL",
    ]
    if issue:
        owner_reason = owner_stale_reason_sql(
            company="%(company)s::uuid", issue="%(issue)s::uuid", run=None
        )
        conditions.append(f"{owner_reason} IS NULL")
        if run:  # named beside the issue: must be the agent's, its status is not judged
            conditions.append(
                "EXISTS (SELECT 1 FROM heartbeat_runs"
                " WHERE id = %(run)s AND company_id = %(company)s AND agent_id = %(agent)s)"
            )
    elif run:  # the run is the owner: one lookup judges it and checks it is the agent's
        owner_reason = owner_stale_reason_sql(
            company="%(company)s::uuid", issue=None, run="%(run)s::uuid", run_agent="%(agent)s"
        )
        conditions.append(f"{owner_reason} IS NULL")
    return (
        f"UPDATE {LEASE_TABLE} SET owner_issue_id = %(issue)s, owner_run_id = %(run)s,"  # noqa: S608
        " owner_agent_id = %(agent)s, last_action = %(action)s, renewed_at = now(),"
        " expires_at = now() + make_interval(secs => %(ttl)s), updated_at = now()"
        f" WHERE {' AND '.join(conditions)}"
        f" RETURNING {LEASE_COLUMNS}"
    )


_FAST_RENEW_SQL: Final = {
    (issue, run): _fast_renew_sql(issue=issue, run=run)
    for issue in (False, True)
    for run in (False, True)
}


# A grant's fence: the current PostgreSQL timeline (the first 8 hex digits of the WAL segment
# name; a promotion starts a new, larger one, and any user may read it) above bit 40, the
# generation below. A failover that lost the last grants may hand a generation out again, but
# on a larger timeline, so fences keep increasing (docs/leases.md#fence).
FENCE_SHIFT: Final = 40
FENCE_SQL: Final = (
    "((('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint"
    f" << {FENCE_SHIFT}) + %s)"
)


def fence_of(*, timeline: int, generation: int) -> int:
    """The fence `FENCE_SQL` computes (a plain function: the ordering it promises is tested
    without a failover)."""
    return (timeline << FENCE_SHIFT) + generation


# Insert and counter bump in one statement, under the workspace row lock already held.
_CREATE_SQL: Final = (
    f"WITH created AS (INSERT INTO {LEASE_TABLE} (id, company_id, execution_workspace_id,"  # noqa: S608
    " owner_key, owner_issue_id, owner_run_id, owner_agent_id, last_action, generation,"
    " claimed_at, renewed_at, expires_at, metadata, created_at, updated_at, fence,"
    " claimed_xid)"
    " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, now(), now(),"
    f" now() + make_interval(secs => %s), NULL, now(), now(), {FENCE_SQL},"
    " pg_current_xact_id()::text::bigint)"
    f" ON CONFLICT (execution_workspace_id) DO NOTHING RETURNING {LEASE_COLUMNS}),"
    " bumped AS (UPDATE execution_workspaces w SET runtime_lease_generation = c.generation"
    " FROM created c WHERE w.id = c.execution_workspace_id)"
    f" SELECT {LEASE_COLUMNS} FROM created"
)


_RECLAIM_SQL: Final = (
    f"WITH reclaimed AS (UPDATE {LEASE_TABLE} SET owner_key = %s, owner_issue_id = %s,"  # noqa: S608
    " owner_run_id = %s, owner_agent_id = %s, last_action = %s, generation = %s,"
    f" fence = {FENCE_SQL},"
    " claimed_at = now(), claimed_xid = pg_current_xact_id()::text::bigint,"
    " renewed_at = now(), expires_at = now() + make_interval(secs => %s),"
    " metadata = jsonb_build_object('reclaimedFromOwnerKey', %s::text, 'reclaimReason',"
    " %s::text, 'reclaimedAt',"
    """ to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')),"""
    f" updated_at = now() WHERE id = %s RETURNING {LEASE_COLUMNS}),"
    " bumped AS (UPDATE execution_workspaces w SET runtime_lease_generation = r.generation"
    " FROM reclaimed r WHERE w.id = r.execution_workspace_id)"
    f" SELECT {LEASE_COLUMNS} FROM reclaimed"
)


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

    An agent whose own owner is stale (the issue its key names missing, hidden or not in an
    eligible status; the run missing or terminal) is refused before any of that and changes
    nothing: a lease it holds stays as it is, reclaimable by others at once.

    Locks: the renew fast path locks only the lease row (one UPDATE). Otherwise the
    workspace row (FOR NO KEY UPDATE), then the lease row (FOR UPDATE); `lock_timeout` 5s.
    Raises InvalidRequest (action, ttl), ExecutionWorkspaceNotFound / OwnerIssueNotFound /
    OwnerRunNotFound (404), OwnerRunForeign (403), RuntimeLeaseOwnerIneligible,
    RuntimeLeaseConflict, RuntimeLeaseContended, ResourceBusy (409). Audits created,
    reclaimed and bypassed claims.
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
                metrics.RUNTIME_LEASE_CLAIMS.labels("renewed").inc()  # committed: no audit row
                return RuntimeLeaseClaim(outcome="renewed", owner_key=owner_key, lease=renewed)
            with transaction.atomic(durable=True):
                ineligible = preconditions(
                    company_id=company_id,
                    execution_workspace_id=execution_workspace_id,
                    owner=owner,
                    judge_owner=True,
                )
                if ineligible is not None:
                    # Before any lock or write: a stale owner neither creates, renews nor
                    # reclaims, whoever holds the lease (docs/leases.md#owner-eligibility).
                    raise RuntimeLeaseOwnerIneligible(
                        execution_workspace_id=str(execution_workspace_id),
                        owner_key=owner_key,
                        reason=ineligible,
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
    row = prepared_fetchone(
        _FAST_RENEW_SQL[owner.issue_id is not None, owner.run_id is not None],
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
    return None if row is None else RuntimeLease.from_row(row)


def _claim_bypass(
    *, company_id: UUID, execution_workspace_id: UUID, action: str, owner: RuntimeLeaseOwner
) -> RuntimeLeaseClaim:
    with transaction.atomic(durable=True):
        preconditions(
            company_id=company_id, execution_workspace_id=execution_workspace_id, owner=owner
        )
        audit(
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

    created = fetch_lease(
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
            next_generation,
        ],
    )
    if created is not None:
        audit(
            owner_actor=actor,
            company_id=company_id,
            execution_workspace_id=execution_workspace_id,
            action="runtime_lease.created",
            run_id=owner.run_id,
            details=lease_details(created),
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
        renewed = fetch_lease(
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
        transaction.on_commit(metrics.RUNTIME_LEASE_CLAIMS.labels("renewed").inc)
        return RuntimeLeaseClaim(outcome="renewed", owner_key=owner_key, lease=renewed)

    reason = runtime_lease_evaluate_stale(lease_id=current.id)
    if reason is None:
        raise _conflict(current, requested_action=action, requested_owner_key=owner_key)

    reclaimed = fetch_lease(
        _RECLAIM_SQL,
        [
            owner_key,
            owner.issue_id,
            owner.run_id,
            owner.agent_id,
            action,
            next_generation,
            next_generation,
            ttl,
            current.owner_key,
            reason,
            current.id,
        ],
    )
    assert reclaimed is not None  # noqa: S101 - the row is locked by this transaction
    audit(
        owner_actor=actor,
        company_id=company_id,
        execution_workspace_id=execution_workspace_id,
        action="runtime_lease.reclaimed",
        run_id=owner.run_id,
        details={
            **lease_details(reclaimed),
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
