"""The board-owned owner-unverified hold (docs/recovery.md#owner-unverified-hold): recorded
when a prior owner can't be shown stopped, restored on a recheck of the same owner, marked
resuming after a platform-proof takeover."""

from __future__ import annotations

from typing import Any
from uuid import UUID

from django.db import transaction
from django.db.models import F, Func, JSONField, Q, Value
from django.db.models.functions import Now

from paperclip.activity import activity_record
from paperclip.db.advisory import advisory_xact_lock
from recovery.locks import recovery_source_key
from recovery.models import LIVE_STATUSES, IssueRecoveryAction
from recovery.selectors.actions import OWNER_UNVERIFIED_CAUSE, owner_fingerprint
from recovery.services.actions import RecoveryActionInput, upsert_source_scoped_in_tx
from recovery.services.ownership.outcomes import NotAcquired, WaitReason

OWNER_UNVERIFIED_NEXT_ACTION = (
    "The previous finalization controller of this run can't be shown to have stopped. Check "
    "through your deployment platform that this exact controller and every workspace "
    'copy-back process it started have exited, then use "Confirm owner stopped and resume '
    'finalization" (admin) or POST /api/issues/{issue_id}/recovery-actions/'
    "resume-workspace-finalization with the stop evidence. That releases only this owner "
    "receipt; the saved result is then finalized without another provider turn. Do not start "
    "a replacement run and do not delete workspace files."
)


def require_stop_verification(
    *,
    company_id: UUID,
    run_id: UUID,
    issue_id: UUID | None,
    agent_id: UUID,
    raw_prior: Any,
    retained: bool,
    platform_pending: bool,
) -> NotAcquired:
    """docs/recovery.md#owner-unverified-hold: record (or restore) the board-owned owner-unverified
    hold."""
    if retained:
        return NotAcquired("owner_unverified")
    reason: WaitReason = "platform_stop_pending" if platform_pending else "owner_unverified"
    if issue_id is None:
        return NotAcquired(reason)
    fingerprint = owner_fingerprint(run_id, raw_prior)
    with transaction.atomic(durable=True):
        advisory_xact_lock(recovery_source_key(company_id, issue_id))
        # The run's own live hold (other runs' holds of the issue are theirs).
        existing = (
            IssueRecoveryAction.objects.filter(
                company_id=company_id, cause=OWNER_UNVERIFIED_CAUSE, status__in=LIVE_STATUSES
            )
            .filter(Q(held_run_id=run_id) | Q(held_run__isnull=True, evidence__runId=str(run_id)))
            .order_by("-updated_at", "-id")
            .first()
        )
        if (
            existing is not None
            and existing.cause == OWNER_UNVERIFIED_CAUSE
            and existing.fingerprint == fingerprint
        ):
            # Rechecking the same physical owner is not a new recovery attempt: restore the
            # copy-back instructions and the operator_required state, spend nothing.
            with transaction.get_connection().cursor() as cursor:
                cursor.execute(
                    "UPDATE issue_recovery_actions SET next_action = %s, "
                    "evidence = jsonb_set(coalesce(evidence, '{}'::jsonb), "
                    "'{workspaceOwnerRecovery}', '{\"state\": \"operator_required\"}'::jsonb), "
                    "updated_at = now() "
                    "WHERE company_id = %s AND id = %s AND fingerprint = %s AND cause = %s "
                    "AND status IN ('active', 'escalated') "
                    "AND evidence -> 'workspaceOwnerStop' IS NULL "
                    "AND (next_action IS DISTINCT FROM %s OR "
                    "evidence #>> '{workspaceOwnerRecovery,state}' "
                    "IS DISTINCT FROM 'operator_required')",
                    [
                        OWNER_UNVERIFIED_NEXT_ACTION,
                        company_id,
                        existing.pk,
                        fingerprint,
                        OWNER_UNVERIFIED_CAUSE,
                        OWNER_UNVERIFIED_NEXT_ACTION,
                    ],
                )
                restored = cursor.rowcount
            if restored:
                activity_record(
                    company_id=company_id,
                    actor_type="system",
                    actor_id="finalization-controller",
                    action="recovery_action.owner_hold_restored",
                    entity_type="issue_recovery_action",
                    entity_id=existing.pk,
                    run_id=run_id,
                    details={"fingerprint": fingerprint},
                )
            return NotAcquired(reason)
        upsert_source_scoped_in_tx(
            company_id=company_id,
            source_issue_id=issue_id,
            data=RecoveryActionInput(
                kind=IssueRecoveryAction.Kind.ACTIVE_RUN_WATCHDOG,
                owner_type=IssueRecoveryAction.OwnerType.BOARD,
                return_owner_agent_id=agent_id,
                cause=OWNER_UNVERIFIED_CAUSE,
                fingerprint=fingerprint,
                evidence={
                    "runId": str(run_id),
                    "owner": raw_prior,
                    "workspaceOwnerRecovery": {"state": "operator_required"},
                },
                next_action=OWNER_UNVERIFIED_NEXT_ACTION,
                wake_policy=None,
                max_attempts=1,
                supersede_on_identity_change=True,
                held_run_id=run_id,
            ),
            actor_id="finalization-controller",
        )
    return NotAcquired(reason)


def record_platform_takeover(
    *, company_id: UUID, run_id: UUID, issue_id: UUID, raw_prior: Any, proof: dict[str, Any]
) -> None:
    activity_record(
        company_id=company_id,
        actor_type="system",
        actor_id="workspace-recovery",
        action="issue.workspace_owner_stop_verified",
        entity_type="issue",
        entity_id=issue_id,
        run_id=run_id,
        details={"proof": proof},
    )
    IssueRecoveryAction.objects.filter(
        company_id=company_id,
        source_issue_id=issue_id,
        cause=OWNER_UNVERIFIED_CAUSE,
        fingerprint=owner_fingerprint(run_id, raw_prior),
        status__in=LIVE_STATUSES,
    ).update(evidence=_jsonb_set_state("resuming"), updated_at=Now())


def _jsonb_set_state(state: str) -> Func:
    """`jsonb_set(coalesce(evidence, '{}'), '{workspaceOwnerRecovery}', {"state": state})`."""
    return Func(
        Func(F("evidence"), Value({}, output_field=JSONField()), function="coalesce"),
        Value("{workspaceOwnerRecovery}"),
        Value({"state": state}, output_field=JSONField()),
        function="jsonb_set",
        output_field=JSONField(),
    )
