"""Reads of the recovery app."""

from __future__ import annotations

from typing import Any
from uuid import UUID

from django.db.models import Q, QuerySet
from django.db.models.functions import Now

from paperclip.models import HeartbeatRun, NativeRunFinalization
from paperclip.receipts import raw_owner
from recovery.canonical import canonical_sha256
from recovery.models import LIVE_STATUSES, IssueRecoveryAction
from recovery.selectors.exports import EXPORT_RETRY_KEY, HELD_EXPORT

OWNER_UNVERIFIED_CAUSE = "native_workspace_finalization_owner_unverified"
WAITING_PHASES = ("result_accepted", "workspace_finalizing")
# The coordinator's failure code while the run is held over a workspace head conflict.
HEAD_CONFLICT_CODE = "workspace_head_conflict"


def owner_fingerprint(run_id: UUID | str, raw_prior: Any) -> str:
    """Identity of an owner-unverified hold: sha256 of canonical `{runId, owner}`."""
    return canonical_sha256({"runId": str(run_id), "owner": raw_prior})


def current_owner_fingerprint(*, company_id: UUID, run_id: UUID) -> str | None:
    """The fingerprint a hold of the run's current owner receipt carries (`owner_fingerprint`),
    or None when the run has no receipt (or is not the company's)."""
    profile = (
        HeartbeatRun.objects.filter(pk=run_id, company_id=company_id)
        .values_list("runner_profile_json", flat=True)
        .first()
    )
    receipt = raw_owner(profile)
    return owner_fingerprint(run_id, receipt) if receipt is not None else None


def recovery_action_get_live(*, company_id: UUID, issue_id: UUID) -> IssueRecoveryAction | None:
    """The newest live (active or escalated) recovery action of the source issue, or None."""
    return (
        IssueRecoveryAction.objects.filter(
            company_id=company_id, source_issue_id=issue_id, status__in=LIVE_STATUSES
        )
        .order_by("-updated_at", "-id")
        .first()
    )


def run_board_hold(*, company_id: UUID, run_id: UUID) -> IssueRecoveryAction | None:
    """The live recovery action the run's finalization waits on the board for, or None. When
    a run was held again while an earlier hold is still live, the one it waits on now comes
    first: an owner-unverified hold whose stop is not confirmed yet and that names the run's
    current owner receipt, then an unresolved workspace head conflict, then a held workspace
    export waiting for its repair, then a held export whose retry is already recorded; the
    oldest within each. An owner hold naming an earlier receipt holds nothing
    (`owner_hold_live`) and is not offered."""
    holds = (
        IssueRecoveryAction.objects.filter(
            company_id=company_id, status__in=LIVE_STATUSES, evidence__runId=str(run_id)
        )
        .filter(
            (Q(cause=OWNER_UNVERIFIED_CAUSE) & ~Q(evidence__has_key="workspaceOwnerStop"))
            | Q(cause=HEAD_CONFLICT_CODE)
            | HELD_EXPORT
        )
        .select_related("source_issue")
        .order_by("created_at", "id")
    )
    current_owner = current_owner_fingerprint(company_id=company_id, run_id=run_id)
    ranked = [
        (rank, hold)
        for hold in holds
        if (rank := _hold_rank(hold, current_owner=current_owner)) is not None
    ]
    return min(ranked, key=lambda pair: pair[0])[1] if ranked else None


def _hold_rank(hold: IssueRecoveryAction, *, current_owner: str | None) -> int | None:
    """Where `hold` comes in `run_board_hold` (lower first), or None when it holds nothing."""
    if hold.cause == OWNER_UNVERIFIED_CAUSE:
        return 0 if current_owner is not None and hold.fingerprint == current_owner else None
    if hold.cause == HEAD_CONFLICT_CODE:
        return 1
    evidence = hold.evidence if isinstance(hold.evidence, dict) else {}
    return 3 if EXPORT_RETRY_KEY in evidence else 2


def recovery_action_list_for_issue(
    *, company_id: UUID, issue_id: UUID
) -> QuerySet[IssueRecoveryAction]:
    return IssueRecoveryAction.objects.filter(
        company_id=company_id, source_issue_id=issue_id
    ).order_by("-created_at", "-id")


def run_issue_id(run: HeartbeatRun) -> UUID | None:
    """coalesce(native_issue_id, issue_id, context_snapshot.issueId)
    (docs/recovery.md#issue-id-resolution)."""
    if run.native_issue_id is not None:
        return run.native_issue_id
    if run.issue_id is not None:
        return run.issue_id
    snapshot: Any = run.context_snapshot
    if isinstance(snapshot, dict) and isinstance(snapshot.get("issueId"), str):
        try:
            return UUID(snapshot["issueId"])
        except ValueError:
            return None
    return None


def finalizations_waiting(*, after_run_id: UUID | None, limit: int) -> list[tuple[UUID, UUID]]:
    """(company_id, run_id) of coordinators waiting for finalization, in run-id order after
    `after_run_id`: phase result_accepted/workspace_finalizing and no future retry time; a run
    held for the board over a workspace head conflict waits for the board, not for a job."""
    qs = (
        NativeRunFinalization.objects.filter(phase__in=WAITING_PHASES)
        .filter(Q(next_attempt_at__isnull=True) | Q(next_attempt_at__lte=Now()))
        .exclude(failure_code=HEAD_CONFLICT_CODE)
    )
    if after_run_id is not None:
        qs = qs.filter(run_id__gt=after_run_id)
    return list(qs.order_by("run_id").values_list("company_id", "run_id")[:limit])
