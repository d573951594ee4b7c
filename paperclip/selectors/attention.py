"""What needs the board's attention, counted: the admin dashboard's tiles (and, through the
same functions, the metrics gauges).

Each kind of stuck work has one queryset builder here; the dashboard counts it and the admin
list filter that its tile links to filters with the very same builder, so a tile's count and
the list it opens always agree. `attention_summary` reads a fixed number of queries whatever
the number of rows (a test pins it) and writes nothing. Database time (`now()`) is the clock.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final, Literal
from uuid import UUID

from django.conf import settings
from django.db.models import Count, Min, Q, QuerySet
from django.db.models.functions import Coalesce, Now
from procrastinate.contrib.django.models import ProcrastinateEvent, ProcrastinateJob

from checkpoints.selectors import expired_authorities
from leases.environment.export_resume import (
    EXPORT_RESUME_KEY,
    STOP_AND_RETAIN_KEY,
    stop_only_cleanup_problem,
)
from leases.models import EnvironmentLease, WorkspaceRuntimeLease
from leases.selectors import (
    STALE,
    STALE_REASON,
    STALE_REASONS,
    among_stale_candidates,
    with_stale_reason,
)
from paperclip.db.clock import db_now
from paperclip.models import NativeRunFinalization
from paperclip.worker.health import freshest_worker_heartbeat
from recovery.models import LIVE_STATUSES, IssueRecoveryAction
from recovery.selectors.actions import OWNER_UNVERIFIED_CAUSE, WAITING_PHASES

TileKind = Literal[
    "finalization_held",
    "finalization_failed",
    "finalization_retrying",
    "runtime_lease_stale",
    "cleanup_failed",
    "cleanup_claim_overdue",
    "cleanup_marker_invalid",
    "authority_expired",
    "job_failed",
    "worker_heartbeat_stale",
]

CompanyIds = Collection[UUID] | None  # None: every company (a superuser)

# Rows whose metadata the two Python checks read (pending cleanups in flight or carrying a
# stop-only intent: normally a handful). Beyond it the two counts are lower bounds.
CLEANUP_CANDIDATE_LIMIT: Final = 5000


@dataclass(frozen=True, slots=True)
class AttentionTile:
    """One kind of stuck work: how many, and since when the oldest has been waiting."""

    kind: TileKind
    title: str
    count: int
    oldest_at: datetime | None
    detail: str | None = None  # the stale reason, for `runtime_lease_stale`
    hint: str = ""


@dataclass(frozen=True, slots=True)
class Attention:
    as_of: datetime  # database time of the read
    tiles: tuple[AttentionTile, ...]
    worker_last_heartbeat_at: datetime | None
    worker_fresh: bool

    @property
    def total(self) -> int:
        return sum(tile.count for tile in self.tiles)


def _scoped[M: QuerySet[Any]](queryset: M, company_ids: CompanyIds) -> M:
    if company_ids is None:
        return queryset
    return queryset.filter(company_id__in=list(company_ids))


# --- The builders (shared with the admin list filters) ---------------------------------------


def held_finalization_actions(
    queryset: QuerySet[IssueRecoveryAction] | None = None,
) -> QuerySet[IssueRecoveryAction]:
    """Owner-unverified holds waiting for the board: live, and no stop confirmed yet."""
    base = IssueRecoveryAction.objects.all() if queryset is None else queryset
    return base.filter(cause=OWNER_UNVERIFIED_CAUSE, status__in=LIVE_STATUSES).exclude(
        evidence__has_key="workspaceOwnerStop"
    )


def failed_finalizations(
    queryset: QuerySet[NativeRunFinalization] | None = None,
) -> QuerySet[NativeRunFinalization]:
    """Coordinators whose copy-back retry budget is spent (waiting for an explicit finalize)."""
    base = NativeRunFinalization.objects.all() if queryset is None else queryset
    return base.filter(phase=NativeRunFinalization.Phase.RETRYABLE_FAILURE)


def retrying_finalizations(
    queryset: QuerySet[NativeRunFinalization] | None = None,
) -> QuerySet[NativeRunFinalization]:
    """Coordinators still waiting for finalization after a failed copy-back attempt."""
    base = NativeRunFinalization.objects.all() if queryset is None else queryset
    return base.filter(phase__in=WAITING_PHASES, failure_code__isnull=False)


def expired_authority_coordinators(
    queryset: QuerySet[NativeRunFinalization] | None = None,
) -> QuerySet[NativeRunFinalization]:
    """Running runs whose controller lease lapsed while they hold checkpoints."""
    found = expired_authorities(clock=Now())
    return found if queryset is None else queryset.filter(pk__in=found.values("pk"))


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
        Q(metadata__pendingCleanupInFlight=True)
        | Q(metadata__has_any_keys=[EXPORT_RESUME_KEY, STOP_AND_RETAIN_KEY])
    )


CleanupCheck = Literal["claim_overdue", "marker_invalid"]


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
        .only(
            "id",
            "company_id",
            "heartbeat_run_id",
            "provider",
            "provider_lease_id",
            "metadata",
            "released_at",
            "updated_at",
        )
        .order_by("pk")[:CLEANUP_CANDIDATE_LIMIT]
    )
    for lease in rows:
        since = lease.released_at or lease.updated_at
        if _claim_overdue(lease, now_ms):
            found["claim_overdue"].append((lease.pk, since))
        if stop_only_cleanup_problem(lease) is not None:
            found["marker_invalid"].append((lease.pk, since))
    return found


def stale_runtime_leases(
    queryset: QuerySet[WorkspaceRuntimeLease] | None = None,
) -> QuerySet[WorkspaceRuntimeLease]:
    """Judged with the shared verdict, among `stale_candidate_ids` only (not every row)."""
    base = WorkspaceRuntimeLease.objects.all() if queryset is None else queryset
    return with_stale_reason(among_stale_candidates(base)).filter(**STALE)


# --- The summary ----------------------------------------------------------------------------


def _aggregate(queryset: QuerySet[Any], oldest: Any) -> tuple[int, datetime | None]:
    row = queryset.order_by().aggregate(n=Count("pk"), oldest=Min(oldest))
    return int(row["n"]), row["oldest"]


def attention_summary(*, company_ids: CompanyIds, include_jobs: bool) -> Attention:
    """Counts and oldest ages of every kind of stuck work in `company_ids` (None: all).

    `include_jobs` adds failed worker jobs, which are not company-scoped (their arguments name
    any company's runs): for superusers only. Reads only, in a fixed number of queries.
    """
    now = db_now()
    tiles: list[AttentionTile] = []

    held = _scoped(held_finalization_actions(), company_ids)
    count, oldest = _aggregate(held, "created_at")
    tiles.append(
        AttentionTile(
            "finalization_held",
            "Finalizations held for the board",
            count,
            oldest,
            hint="A finalization owner can't be proven stopped: verify, then confirm.",
        )
    )
    coordinators = _scoped(NativeRunFinalization.objects.all(), company_ids)
    count, oldest = _aggregate(failed_finalizations(coordinators), "updated_at")
    tiles.append(
        AttentionTile(
            "finalization_failed",
            "Finalizations failed (retries spent)",
            count,
            oldest,
            hint="Fix the copy-back cause, then finalize now.",
        )
    )
    count, oldest = _aggregate(retrying_finalizations(coordinators), "updated_at")
    tiles.append(
        AttentionTile(
            "finalization_retrying",
            "Finalizations retrying",
            count,
            oldest,
            hint="A copy-back attempt failed; the worker retries with back-off.",
        )
    )

    leases = _scoped(WorkspaceRuntimeLease.objects.all(), company_ids)
    by_reason = {
        row[STALE_REASON]: (row["n"], row["oldest"])
        for row in stale_runtime_leases(leases)
        .order_by()
        .values(STALE_REASON)
        .annotate(n=Count("pk"), oldest=Min("renewed_at"))
    }
    for reason in STALE_REASONS:
        count, oldest = by_reason.get(reason, (0, None))
        tiles.append(
            AttentionTile(
                "runtime_lease_stale",
                f"Stale runtime leases: {reason.replace('_', ' ')}",
                count,
                oldest,
                detail=reason,
                hint="Reclaimed by the next claim or the sweep; force-release if it blocks.",
            )
        )

    environment = _scoped(EnvironmentLease.objects.all(), company_ids)
    count, oldest = _aggregate(failed_cleanups(environment), Coalesce("released_at", "updated_at"))
    tiles.append(
        AttentionTile(
            "cleanup_failed",
            "Environment cleanups failed",
            count,
            oldest,
            hint="The last receipt did not settle; retried with back-off.",
        )
    )
    checks = cleanup_attention(environment, now=now)
    for kind, key, title, hint in (
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
    ):
        rows = checks[key]  # type: ignore[index]
        tiles.append(
            AttentionTile(
                kind,  # type: ignore[arg-type]
                title,
                len(rows),
                min((since for _, since in rows), default=None),
                hint=hint,
            )
        )

    authorities = _scoped(expired_authority_coordinators(), company_ids)
    count, oldest = _aggregate(authorities, Coalesce("lease_expires_at", "updated_at"))
    tiles.append(
        AttentionTile(
            "authority_expired",
            "Expired runner authorities with checkpoints",
            count,
            oldest,
            hint="Cleared by expire_runner_authorities (every 60 s in the worker).",
        )
    )

    if include_jobs:
        failed = ProcrastinateJob.objects.filter(status="failed")
        row = failed.aggregate(n=Count("pk"))
        first = (
            ProcrastinateEvent.objects.filter(job__status="failed", type="failed")
            .aggregate(oldest=Min("at"))
            .get("oldest")
        )
        tiles.append(
            AttentionTile(
                "job_failed",
                "Failed worker jobs",
                int(row["n"]),
                first,
                hint="See the job's error; retry it from the job list.",
            )
        )

    heartbeat = freshest_worker_heartbeat()
    fresh_after = timedelta(seconds=settings.PAPERCLIP_WORKER_READY_SECONDS)
    fresh = heartbeat is not None and heartbeat > now - fresh_after
    tiles.append(
        AttentionTile(
            "worker_heartbeat_stale",
            "Worker heartbeat",
            0 if fresh else 1,
            heartbeat,
            hint=(
                "A worker is alive."
                if fresh
                else "No worker heartbeat is fresh: finalizations and sweeps are not running."
            ),
        )
    )
    return Attention(
        as_of=now, tiles=tuple(tiles), worker_last_heartbeat_at=heartbeat, worker_fresh=fresh
    )
