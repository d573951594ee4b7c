"""Recovery's stuck work for the console: finalizations held for the board, failed (retries
spent) and retrying. One builder per kind, shared by the dashboard tile (`TILES`) and the admin
list filter it links to, so the two always agree."""

from __future__ import annotations

from django.db.models import QuerySet

from paperclip.attention import TileSource, counted_tile
from paperclip.models import NativeRunFinalization
from recovery.models import LIVE_STATUSES, IssueRecoveryAction
from recovery.selectors.actions import OWNER_UNVERIFIED_CAUSE, WAITING_PHASES


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


TILES: tuple[TileSource, ...] = (
    counted_tile(
        "finalization_held",
        "Finalizations held for the board",
        "A finalization owner can't be proven stopped: verify, then confirm.",
        held_finalization_actions,
        IssueRecoveryAction.objects.all,
        "created_at",
        ("admin:recovery_issuerecoveryaction_changelist", {"hold": "board"}),
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
