"""Environment leases' stuck work for the console: cleanups that failed, claims that were
never answered, and stop-only markers that do not bind. The builders serve the dashboard tiles
(`TILES`) and the environment lease list's attention filter alike."""

from __future__ import annotations

from datetime import datetime
from typing import Final, Literal
from uuid import UUID

from django.db.models import Q, QuerySet
from django.db.models.functions import Coalesce

from leases.environment.export_resume.keys import STOP_ONLY_KEYS, STOP_ONLY_READ_FIELDS
from leases.environment.export_resume.markers import stop_only_cleanup_problem
from leases.models import EnvironmentLease
from paperclip.attention import (
    AttentionScope,
    AttentionTile,
    TileSource,
    counted_tile,
    links,
    scoped,
)
from paperclip.db.clock import db_now

# Rows whose metadata the two Python checks read (pending cleanups in flight or carrying a
# stop-only intent: normally a handful). Beyond it the two counts are lower bounds.
CLEANUP_CANDIDATE_LIMIT: Final = 5000

CleanupCheck = Literal["claim_overdue", "marker_invalid"]


def failed_cleanups(
    queryset: QuerySet[EnvironmentLease] | None = None,
) -> QuerySet[EnvironmentLease]:
    base = EnvironmentLease.objects.all() if queryset is None else queryset
    return base.filter(
        status=EnvironmentLease.Status.PENDING_CLEANUP,
        cleanup_status=EnvironmentLease.CleanupStatus.FAILED,
    )


def _cleanup_candidates(queryset: QuerySet[EnvironmentLease]) -> QuerySet[EnvironmentLease]:
    """Pending cleanups with a claim in flight or a stop-only intent: the only rows whose
    metadata the two Python checks below need to read."""
    return queryset.filter(status=EnvironmentLease.Status.PENDING_CLEANUP).filter(
        Q(metadata__pendingCleanupInFlight=True) | Q(metadata__has_any_keys=list(STOP_ONLY_KEYS))
    )


def _claim_overdue(lease: EnvironmentLease, now_ms: int) -> bool:
    metadata = lease.metadata if isinstance(lease.metadata, dict) else {}
    expires = metadata.get("pendingCleanupLeaseExpiresAtMs")
    return (
        metadata.get("pendingCleanupInFlight") is True
        and isinstance(expires, int)
        and not isinstance(expires, bool)
        and expires <= now_ms
    )


def cleanup_attention(
    queryset: QuerySet[EnvironmentLease] | None = None, *, now: datetime | None = None
) -> dict[CleanupCheck, list[tuple[UUID, datetime]]]:
    """Pending cleanups whose claim expired without a receipt (`claim_overdue`) and leases
    whose stop-only intent does not bind (`marker_invalid`: never cleaned up automatically),
    as (lease id, waiting since) pairs. One query."""
    base = EnvironmentLease.objects.all() if queryset is None else queryset
    now_ms = int((now or db_now()).timestamp() * 1000)
    found: dict[CleanupCheck, list[tuple[UUID, datetime]]] = {
        "claim_overdue": [],
        "marker_invalid": [],
    }
    rows = (
        _cleanup_candidates(base)
        .only(*STOP_ONLY_READ_FIELDS, "released_at", "updated_at")
        .order_by("pk")[:CLEANUP_CANDIDATE_LIMIT]
    )
    for lease in rows:
        since = lease.released_at or lease.updated_at
        if _claim_overdue(lease, now_ms):
            found["claim_overdue"].append((lease.pk, since))
        if stop_only_cleanup_problem(lease) is not None:
            found["marker_invalid"].append((lease.pk, since))
    return found


_CHECK_TILES: tuple[tuple[str, CleanupCheck, str, str], ...] = (
    (
        "cleanup_claim_overdue",
        "claim_overdue",
        "Environment cleanups claimed too long",
        "A provider worker claimed the cleanup and never answered.",
    ),
    (
        "cleanup_marker_invalid",
        "marker_invalid",
        "Cleanups blocked: invalid stop-only marker",
        "Never cleaned up automatically: an operator must inspect it.",
    ),
)


def _cleanup_checks(scope: AttentionScope) -> list[AttentionTile]:
    checks = cleanup_attention(
        scoped(EnvironmentLease.objects.all(), scope.company_ids), now=scope.now
    )
    return [
        AttentionTile(
            kind, title, len(checks[key]), min((s for _, s in checks[key]), default=None), hint=hint
        )
        for kind, key, title, hint in _CHECK_TILES
    ]


TILES: tuple[TileSource, ...] = (
    counted_tile(
        "cleanup_failed",
        "Environment cleanups failed",
        "The last receipt did not settle; retried with back-off.",
        failed_cleanups,
        EnvironmentLease.objects.all,
        Coalesce("released_at", "updated_at"),
        ("admin:leases_environmentlease_changelist", {"attention": "cleanup_failed"}),
    ),
    TileSource(
        ("cleanup_claim_overdue", "cleanup_marker_invalid"),
        _cleanup_checks,
        links(
            {
                "cleanup_claim_overdue": (
                    "admin:leases_environmentlease_changelist",
                    {"attention": "claim_overdue"},
                ),
                "cleanup_marker_invalid": (
                    "admin:leases_environmentlease_changelist",
                    {"stop_only": "invalid"},
                ),
            }
        ),
    ),
)
