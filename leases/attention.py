"""Leases' stuck work for the console: stale runtime leases, one tile per stale reason. The
builder serves the dashboard tiles (`TILES`) and the lease list's stale filter alike."""

from __future__ import annotations

from django.db.models import Count, Min, QuerySet

from leases.models import WorkspaceRuntimeLease
from leases.orphans import orphaned_runs
from leases.selectors import (
    STALE,
    STALE_REASON,
    STALE_REASONS,
    among_stale_candidates,
    with_stale_reason,
)
from paperclip.attention import AttentionScope, AttentionTile, TileSource, scoped


def stale_runtime_leases(
    queryset: QuerySet[WorkspaceRuntimeLease] | None = None,
) -> QuerySet[WorkspaceRuntimeLease]:
    """Judged with the shared verdict, among `stale_candidate_ids` only (not every row)."""
    base = WorkspaceRuntimeLease.objects.all() if queryset is None else queryset
    return with_stale_reason(among_stale_candidates(base)).filter(**STALE)


def _stale_by_reason(scope: AttentionScope) -> list[AttentionTile]:
    leases = scoped(WorkspaceRuntimeLease.objects.all(), scope.company_ids)
    by_reason = {
        row[STALE_REASON]: (row["n"], row["oldest"])
        for row in stale_runtime_leases(leases)
        .order_by()
        .values(STALE_REASON)
        .annotate(n=Count("pk"), oldest=Min("renewed_at"))
    }
    hint = "Reclaimed by the next claim or the sweep; force-release if it blocks."
    return [
        AttentionTile(
            "runtime_lease_stale",
            f"Stale runtime leases: {reason.replace('_', ' ')}",
            *by_reason.get(reason, (0, None)),
            detail=reason,
            hint=hint,
        )
        for reason in STALE_REASONS
    ]


def _orphaned_runs(scope: AttentionScope) -> list[AttentionTile]:
    found = orphaned_runs(company_ids=scope.company_ids, limit=10_000)
    oldest = min((o.since for o in found if o.since is not None), default=None)
    hint = (
        "Running, but every lease lapsed: its agent is gone. The worker interrupts it after "
        "the grace, and so does the next run that starts on its issue; the board can now: "
        "Interrupt run… on the run's page (or POST /api/heartbeat-runs/{id}/interrupt)."
    )
    return [AttentionTile("run_orphaned", "Orphaned runs", len(found), oldest, hint=hint)]


TILES: tuple[TileSource, ...] = (
    TileSource(
        ("runtime_lease_stale",),
        _stale_by_reason,
        lambda kind, detail: (
            "admin:leases_workspaceruntimelease_changelist",
            {"stale_reason": detail or ""},
        ),
    ),
    TileSource(
        ("run_orphaned",),
        _orphaned_runs,
        lambda kind, detail: ("admin:paperclip_heartbeatrun_changelist", {"orphaned": "yes"}),
    ),
)
