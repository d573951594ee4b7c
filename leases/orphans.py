"""Orphaned runs (docs/leases.md#orphaned-runs): a `running` run every lease of which has
lapsed on the database clock, the runtime lease naming it (as owner run, or owner issue) and
its controller lease, and that has no accepted result (finalization carries those). Such a run
was left by an agent that died (kill -9, a lost host): nothing will ever end it but us.

`orphaned_since` is when its last lease lapsed; a run that never held a lease (it just started,
or it does not use leases) is never judged orphaned, nor is one whose only lease, a runtime
lease, the sweep already removed (the CLI's runs also hold a controller lease). The worker
moves a run orphaned for longer than `PAPERCLIP_ORPHANED_RUN_GRACE_SECONDS` to `interrupted`,
releasing its issue's execution lock; the board can do it at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final
from uuid import UUID

from django.db import connection

from leases.selectors import LEASE_TABLE
from paperclip.errors import DomainError
from paperclip.services import run_interrupt
from paperclip.services.runs import HolderLiveness

SWEEPER: Final = "orphaned_run_sweep"

_ORPHANED_SQL: Final = f"""
    SELECT r.id, r.company_id,
           greatest(lease.lapsed, f.lease_expires_at) AS since
    FROM heartbeat_runs r
    LEFT JOIN native_run_finalizations f ON f.run_id = r.id
    LEFT JOIN LATERAL (
        SELECT max(l.expires_at) AS lapsed, bool_or(l.expires_at > now()) AS live
        FROM {LEASE_TABLE} l
        WHERE l.owner_run_id = r.id
           OR l.owner_issue_id = coalesce(r.native_issue_id, r.issue_id)
    ) lease ON true
    WHERE r.status = 'running'
      AND f.result_id IS NULL
      AND coalesce(lease.live, false) = false
      AND (f.lease_expires_at IS NULL OR f.lease_expires_at <= now())
      -- It held a lease that lapsed: a run that never held one (just started, or one that
      -- does not use leases) is not judged.
      AND (lease.lapsed IS NOT NULL OR f.lease_expires_at IS NOT NULL)
"""  # noqa: S608 - constant identifiers


@dataclass(frozen=True, slots=True)
class OrphanedRun:
    run_id: UUID
    company_id: UUID
    since: datetime | None


def orphaned_runs(
    *,
    company_ids: Iterable[UUID] | None = None,
    run_ids: Iterable[UUID] | None = None,
    lapsed_for_seconds: float | None = None,
    limit: int = 1000,
) -> list[OrphanedRun]:
    """Orphaned runs, oldest first: among `company_ids` / `run_ids` when given, orphaned for at
    least `lapsed_for_seconds` when given. Reads only."""
    sql = _ORPHANED_SQL
    params: dict[str, Any] = {}
    if company_ids is not None:
        sql += " AND r.company_id = ANY(%(companies)s::uuid[])"
        params["companies"] = list(company_ids)
    if run_ids is not None:
        sql += " AND r.id = ANY(%(runs)s::uuid[])"
        params["runs"] = list(run_ids)
    if lapsed_for_seconds is not None:
        sql = (
            f"SELECT * FROM ({sql}) o WHERE o.since IS NULL"  # noqa: S608 - constant text
            " OR o.since <= now() - make_interval(secs => %(grace)s)"
        )
        params["grace"] = lapsed_for_seconds
    sql = f"SELECT * FROM ({sql}) o ORDER BY o.since NULLS FIRST, o.id LIMIT %(limit)s"  # noqa: S608
    params["limit"] = limit
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return [OrphanedRun(row[0], row[1], row[2]) for row in cursor.fetchall()]


def run_orphaned_since(run_id: UUID) -> datetime | None:
    """When the run became orphaned, or None while something keeps it alive (or it ended)."""
    found = orphaned_runs(run_ids=[run_id], limit=1)
    if not found:
        return None
    return found[0].since


def run_liveness(run_id: UUID) -> HolderLiveness:
    """A holder's liveness for a run start that meets it (registered with the core): whether
    it is orphaned now, its leases' last renewal, and when it became or would become orphaned
    (its leases' last expiry)."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            SELECT max(l.renewed_at),
                   greatest(max(l.expires_at), f.lease_expires_at)
            FROM heartbeat_runs r
            LEFT JOIN native_run_finalizations f ON f.run_id = r.id
            LEFT JOIN {LEASE_TABLE} l
              ON l.owner_run_id = r.id OR l.owner_issue_id = coalesce(r.native_issue_id, r.issue_id)
            WHERE r.id = %s
            GROUP BY f.lease_expires_at
            """,  # noqa: S608 - constant identifiers
            [run_id],
        )
        row = cursor.fetchone()
    orphan = orphaned_runs(run_ids=[run_id], limit=1)
    return HolderLiveness(
        orphaned=bool(orphan),
        last_renewed_at=row[0] if row else None,
        orphaned_at=orphan[0].since if orphan else (row[1] if row else None),
    )


@dataclass(frozen=True, slots=True)
class OrphanSweep:
    examined: int = 0
    interrupted: int = 0
    revived: int = 0  # a lease came back (or the run ended) between the pass and its lock
    failed: tuple[str, ...] = ()


def orphaned_runs_interrupt(
    *,
    grace_seconds: float,
    batch_size: int = 200,
    progress: Callable[[UUID, str], None] | None = None,
) -> OrphanSweep:
    """Interrupt every run orphaned for longer than `grace_seconds` (audit reason `orphaned`),
    one transaction a run, each re-judged under its row lock (a renew in between keeps it).
    `progress` hears each run's outcome (`interrupted`, `revived`, or the error's code)."""
    candidates = orphaned_runs(lapsed_for_seconds=grace_seconds, limit=batch_size)
    interrupted = revived = 0
    failed: list[str] = []

    def still(run_id: UUID) -> bool:
        return bool(orphaned_runs(run_ids=[run_id], lapsed_for_seconds=grace_seconds, limit=1))

    for orphan in candidates:
        try:
            done = run_interrupt(
                company_ids=None,
                run_id=orphan.run_id,
                actor_type="system",
                actor_id=SWEEPER,
                reason="orphaned",
                still=lambda run: still(run.pk),
            )
        except DomainError as exc:
            failed.append(f"{orphan.run_id}: {exc.code}")
            if progress is not None:
                progress(orphan.run_id, exc.code)
            continue
        if done is None:
            revived += 1
        else:
            interrupted += 1
        if progress is not None:
            progress(orphan.run_id, "revived" if done is None else "interrupted")
    return OrphanSweep(len(candidates), interrupted, revived, tuple(failed))
