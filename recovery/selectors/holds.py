"""The board's holds of runs (docs/recovery.md#one-hold-per-held-run), by reason: what each
one waits for and what the board does about it. One table serves the dashboard's "held for the
board" tiles, the admin list filter they open, and the remediation of `finalize`'s 409."""

from __future__ import annotations

from typing import Final

from django.db.models import F, Q, QuerySet

from paperclip.receipts import OWNER_KEY
from recovery.models import LIVE_STATUSES, IssueRecoveryAction
from recovery.selectors.actions import HEAD_CONFLICT_CODE, OWNER_UNVERIFIED_CAUSE
from recovery.selectors.exports import HELD_EXPORT

OWNER_UNVERIFIED: Final = "owner_unverified"
PLATFORM_STOP_PENDING: Final = "platform_stop_pending"
HEAD_CONFLICT: Final = HEAD_CONFLICT_CODE
EXPORT_RETRY_EXHAUSTED: Final = "workspace_export_retry_exhausted"

# The reason a tile or a 409 names → what the board does about it.
HOLD_REMEDIATION: Final[dict[str, str]] = {
    OWNER_UNVERIFIED: (
        "A finalization owner can't be proven stopped: verify that its controller and every "
        "copy-back it started have stopped, then Confirm owner stopped and resume finalization "
        "on the hold (or POST /api/issues/{issue_id}/recovery-actions/"
        "resume-workspace-finalization); the worker then finalizes the saved result."
    ),
    PLATFORM_STOP_PENDING: (
        "The worker platform has not reported the prior worker stopped yet: the reconciler "
        "looks for its stop receipt every period; if it never comes, verify the stop and "
        "confirm it on the hold."
    ),
    HEAD_CONFLICT: (
        "The run's changes overlap changes another run published since its base: nothing "
        "waits for a retry. Open the hold, compare the run's tree with the head, and resolve "
        "it (POST /api/issues/{issue_id}/recovery-actions/resolve-workspace-conflict); the "
        "worker then finalizes the run."
    ),
    EXPORT_RETRY_EXHAUSTED: (
        "Exporting the saved result into the workspace failed on every attempt: repair the "
        "cause the hold's last failure names (disk, permissions, the cwd, the sandbox), then "
        "Retry workspace export on the hold."
    ),
}

# The tiles' order, and their titles.
TILE_REASONS: Final[tuple[tuple[str, str], ...]] = (
    (OWNER_UNVERIFIED, "owner unverified"),
    (HEAD_CONFLICT, "workspace head conflict"),
    (EXPORT_RETRY_EXHAUSTED, "export retries spent"),
)

# An owner-unverified hold waits for the board while its stop is not confirmed and it names the
# owner receipt its run carries now (`owner_hold_live`): one naming an earlier owner (released,
# taken over) holds nothing, so it is neither counted nor listed as held.
_OWNER_HOLD: Final = (
    Q(cause=OWNER_UNVERIFIED_CAUSE)
    & ~Q(evidence__has_key="workspaceOwnerStop")
    & Q(evidence__owner=F(f"held_run__runner_profile_json__{OWNER_KEY}"))
)
HOLD_FILTERS: Final[dict[str, Q]] = {
    OWNER_UNVERIFIED: _OWNER_HOLD,
    HEAD_CONFLICT: Q(cause=HEAD_CONFLICT_CODE),
    EXPORT_RETRY_EXHAUSTED: HELD_EXPORT,
}


def board_holds(
    queryset: QuerySet[IssueRecoveryAction] | None = None, *, reason: str | None = None
) -> QuerySet[IssueRecoveryAction]:
    """Live holds of runs waiting for the board: all of them, or those of one tile reason."""
    base = IssueRecoveryAction.objects.all() if queryset is None else queryset
    if reason is not None:
        match = HOLD_FILTERS.get(reason, Q(pk__in=[]))
    else:
        match = _OWNER_HOLD | Q(cause=HEAD_CONFLICT_CODE) | HELD_EXPORT
    return base.filter(status__in=LIVE_STATUSES).filter(match)
