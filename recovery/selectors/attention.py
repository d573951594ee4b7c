"""Recovery's stuck work for the console: finalizations held for the board (one tile per hold
reason, each with its own remediation), failed (retries spent) and retrying. One builder per
kind, shared by the dashboard tile (`TILES`) and the admin list filter it links to, so the two
always agree."""

from __future__ import annotations

from django.db.models import Count, Min, QuerySet

from paperclip.attention import AttentionScope, AttentionTile, TileSource, counted_tile, scoped
from paperclip.models import NativeRunFinalization
from recovery.models import IssueRecoveryAction
from recovery.selectors.actions import HEAD_CONFLICT_CODE, WAITING_PHASES
from recovery.selectors.holds import (
    EXPORT_RETRY_EXHAUSTED,
    HOLD_FILTERS,
    HOLD_REMEDIATION,
    OWNER_UNVERIFIED,
    TILE_REASONS,
    board_holds,
)


def held_finalization_actions(
    queryset: QuerySet[IssueRecoveryAction] | None = None,
) -> QuerySet[IssueRecoveryAction]:
    """Owner-unverified holds waiting for the board: live, no stop confirmed yet, and naming
    the owner receipt their run carries now."""
    return board_holds(queryset, reason=OWNER_UNVERIFIED)


def failed_finalizations(
    queryset: QuerySet[NativeRunFinalization] | None = None,
) -> QuerySet[NativeRunFinalization]:
    """Coordinators whose copy-back retry budget is spent (waiting for an explicit finalize),
    unless their run's held export is on the "held for the board" tile already."""
    base = NativeRunFinalization.objects.all() if queryset is None else queryset
    held = board_holds(reason=EXPORT_RETRY_EXHAUSTED).exclude(held_run=None).values("held_run_id")
    return base.filter(phase=NativeRunFinalization.Phase.RETRYABLE_FAILURE).exclude(run_id__in=held)


def retrying_finalizations(
    queryset: QuerySet[NativeRunFinalization] | None = None,
) -> QuerySet[NativeRunFinalization]:
    """Coordinators still waiting for finalization after a failed copy-back attempt, which the
    worker retries; a run held over a workspace head conflict waits for the board instead."""
    base = NativeRunFinalization.objects.all() if queryset is None else queryset
    return base.filter(phase__in=WAITING_PHASES, failure_code__isnull=False).exclude(
        failure_code=HEAD_CONFLICT_CODE
    )


def _held_by_reason(scope: AttentionScope) -> list[AttentionTile]:
    """Every board hold of a run, one tile per reason with its own remediation: one query."""
    holds = board_holds(scoped(IssueRecoveryAction.objects.all(), scope.company_ids))
    row = holds.order_by().aggregate(
        **{
            f"n_{reason}": Count("pk", filter=HOLD_FILTERS[reason])
            for reason, _words in TILE_REASONS
        },
        **{
            f"oldest_{reason}": Min("created_at", filter=HOLD_FILTERS[reason])
            for reason, _words in TILE_REASONS
        },
    )
    return [
        AttentionTile(
            "finalization_held",
            f"Finalizations held for the board: {words}",
            int(row[f"n_{reason}"]),
            row[f"oldest_{reason}"],
            detail=reason,
            hint=HOLD_REMEDIATION[reason],
        )
        for reason, words in TILE_REASONS
    ]


TILES: tuple[TileSource, ...] = (
    TileSource(
        ("finalization_held",),
        _held_by_reason,
        lambda kind, detail: (
            "admin:recovery_issuerecoveryaction_changelist",
            {"hold": detail or "board"},
        ),
    ),
    counted_tile(
        "finalization_failed",
        "Finalizations failed (retries spent)",
        "The export is held: repair its cause, then Retry workspace export on the run.",
        failed_finalizations,
        NativeRunFinalization.objects.all,
        "updated_at",
        ("admin:paperclip_nativerunfinalization_changelist", {"attention": "failed"}),
    ),
    counted_tile(
        "finalization_retrying",
        "Finalizations retrying",
        "A copy-back attempt failed; the worker retries with back-off.",
        retrying_finalizations,
        NativeRunFinalization.objects.all,
        "updated_at",
        ("admin:paperclip_nativerunfinalization_changelist", {"attention": "retrying"}),
    ),
)
