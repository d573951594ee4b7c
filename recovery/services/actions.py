"""The single writer of an issue's live recovery action (docs/recovery.md#recovery-actions)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal
from uuid import UUID

from django.db import IntegrityError, transaction
from django.db.models import Q
from django.db.models.functions import Now

from paperclip.activity import activity_record
from paperclip.db.advisory import advisory_xact_lock
from paperclip.db.clock import db_now_iso
from paperclip.db.locking import require_transaction
from recovery.errors import RecoveryActionNotFound, RecoveryHoldNotDismissable
from recovery.locks import recovery_actions_for_update, recovery_source_key
from recovery.models import LIVE_STATUSES, IssueRecoveryAction
from recovery.selectors.actions import OWNER_UNVERIFIED_CAUSE

logger = logging.getLogger(__name__)

UNIQUE_RACE_RETRIES = 3
SUPERSEDED_NOTE = "Superseded: a new failure with a different identity replaced this action."

UpsertOutcome = Literal["created", "superseded", "updated", "escalated", "unchanged"]


@dataclass(frozen=True, slots=True)
class RecoveryUpsert:
    action: IssueRecoveryAction
    outcome: UpsertOutcome


@dataclass(frozen=True, slots=True)
class RecoveryActionInput:
    """What a detector knows about a failure of the source issue."""

    kind: str
    cause: str
    fingerprint: str
    evidence: dict[str, Any]
    next_action: str
    owner_type: str | None = None
    owner_agent_id: UUID | None = None
    owner_user_id: str | None = None
    return_owner_agent_id: UUID | None = None
    wake_policy: dict[str, Any] | None = None
    monitor_policy: dict[str, Any] | None = None
    max_attempts: int | None = None
    attempt_count: int | None = None
    evidence_on_create: dict[str, Any] | None = None
    supersede_on_identity_change: bool = False
    preserve_existing_owner: bool = False
    # A board hold of this run: the run's own hold, never another action of the issue
    # (docs/recovery.md#one-hold-per-held-run).
    held_run_id: UUID | None = None


def _exhausted(action: IssueRecoveryAction) -> bool:
    evidence = action.evidence if isinstance(action.evidence, dict) else {}
    budget = evidence.get("recoveryBudget")
    return isinstance(budget, dict) and budget.get("state") == "exhausted"


def _audit(action: IssueRecoveryAction, verb: str, actor_id: str, **details: Any) -> None:
    activity_record(
        company_id=action.company_id,
        actor_type="system",
        actor_id=actor_id,
        action=f"recovery_action.{verb}",
        entity_type="issue_recovery_action",
        entity_id=action.pk,
        details={"sourceIssueId": str(action.source_issue_id), "cause": action.cause, **details},
    )


def _insert(
    *, company_id: UUID, source_issue_id: UUID, data: RecoveryActionInput
) -> IssueRecoveryAction:
    owner_type = data.owner_type or ("agent" if data.owner_agent_id else "board")
    action = IssueRecoveryAction(
        company_id=company_id,
        source_issue_id=source_issue_id,
        kind=data.kind,
        status=IssueRecoveryAction.Status.ACTIVE,
        owner_type=owner_type,
        owner_agent_id=data.owner_agent_id,
        owner_user_id=data.owner_user_id,
        return_owner_agent_id=data.return_owner_agent_id,
        cause=data.cause,
        fingerprint=data.fingerprint,
        evidence={**data.evidence, **(data.evidence_on_create or {})},
        next_action=data.next_action,
        wake_policy=data.wake_policy,
        monitor_policy=data.monitor_policy,
        attempt_count=data.attempt_count if data.attempt_count is not None else 1,
        max_attempts=data.max_attempts,
        last_attempt_at=Now(),
        held_run_id=data.held_run_id,
    )
    # The savepoint is what lets us recover from a unique-index race and retry.
    with transaction.atomic():
        action.save(force_insert=True)
    action.refresh_from_db()
    return action


def _supersede(live: IssueRecoveryAction) -> None:
    live.status = IssueRecoveryAction.Status.CANCELLED
    live.outcome = IssueRecoveryAction.Outcome.CANCELLED
    live.resolution_note = SUPERSEDED_NOTE
    live.resolved_at = Now()
    live.updated_at = Now()
    live.save(update_fields=["status", "outcome", "resolution_note", "resolved_at", "updated_at"])


def _upsert_run_hold(
    *, company_id: UUID, source_issue_id: UUID, data: RecoveryActionInput, actor_id: str
) -> RecoveryUpsert:
    """A board hold of one run: only that run's live hold of the same cause is its to update
    or supersede; the issue's other actions (other runs' holds included) are left alone. A hold
    already waits for the board, so no attempt budget escalates it."""
    live = (
        recovery_actions_for_update()
        .filter(company_id=company_id, cause=data.cause, status__in=LIVE_STATUSES)
        # A hold written without the column (an older writer) is found by its evidence.
        .filter(
            Q(held_run_id=data.held_run_id)
            | Q(held_run__isnull=True, evidence__runId=str(data.held_run_id))
        )
        .order_by("created_at", "id")
        .first()
    )
    if live is None:
        action = _insert(company_id=company_id, source_issue_id=source_issue_id, data=data)
        _audit(action, "created", actor_id, fingerprint=action.fingerprint)
        return RecoveryUpsert(action, "created")
    if data.supersede_on_identity_change and live.fingerprint != data.fingerprint:
        _supersede(live)
        action = _insert(company_id=company_id, source_issue_id=source_issue_id, data=data)
        _audit(action, "superseded", actor_id, supersededActionId=str(live.pk))
        return RecoveryUpsert(action, "superseded")
    previous = live.evidence if isinstance(live.evidence, dict) else {}
    live.evidence = {**previous, **data.evidence} if data.preserve_existing_owner else data.evidence
    live.fingerprint = data.fingerprint
    live.next_action = data.next_action
    live.held_run_id = data.held_run_id
    live.attempt_count += 1
    live.last_attempt_at = Now()
    live.updated_at = Now()
    live.save(
        update_fields=[
            "evidence",
            "fingerprint",
            "next_action",
            "held_run",
            "attempt_count",
            "last_attempt_at",
            "updated_at",
        ]
    )
    live.refresh_from_db()
    _audit(live, "updated", actor_id, attemptCount=live.attempt_count)
    return RecoveryUpsert(live, "updated")


def _upsert_once(
    *, company_id: UUID, source_issue_id: UUID, data: RecoveryActionInput, actor_id: str
) -> RecoveryUpsert:
    if data.held_run_id is not None:
        return _upsert_run_hold(
            company_id=company_id, source_issue_id=source_issue_id, data=data, actor_id=actor_id
        )
    # The issue's single live action; the board's holds of runs are not it.
    live = (
        recovery_actions_for_update()
        .filter(
            company_id=company_id,
            source_issue_id=source_issue_id,
            status__in=LIVE_STATUSES,
            held_run__isnull=True,
        )
        .order_by("-updated_at", "-id")
        .first()
    )
    if live is None:
        action = _insert(company_id=company_id, source_issue_id=source_issue_id, data=data)
        _audit(action, "created", actor_id, fingerprint=action.fingerprint)
        return RecoveryUpsert(action, "created")
    identity_changed = (live.cause, live.fingerprint) != (data.cause, data.fingerprint)
    if data.supersede_on_identity_change and identity_changed:
        _supersede(live)
        action = _insert(company_id=company_id, source_issue_id=source_issue_id, data=data)
        _audit(action, "superseded", actor_id, supersededActionId=str(live.pk))
        return RecoveryUpsert(action, "superseded")
    if _exhausted(live):
        return RecoveryUpsert(live, "unchanged")
    max_attempts = data.max_attempts if data.max_attempts is not None else live.max_attempts
    if max_attempts is not None and live.attempt_count + 1 > max_attempts:
        # The budget would be exceeded: hand the issue to the board instead of retrying.
        return _escalate(live, data, max_attempts=max_attempts, actor_id=actor_id)
    return _update_live(live, data, max_attempts=max_attempts, actor_id=actor_id)


def _escalate(
    live: IssueRecoveryAction, data: RecoveryActionInput, *, max_attempts: int, actor_id: str
) -> RecoveryUpsert:
    """The live action, its attempt budget spent, handed to the board (`escalated`)."""
    used = live.attempt_count
    live.status = IssueRecoveryAction.Status.ESCALATED
    live.owner_type = IssueRecoveryAction.OwnerType.BOARD
    live.owner_agent_id = None
    live.owner_user_id = None
    live.wake_policy = None
    live.monitor_policy = None
    live.max_attempts = max_attempts
    live.evidence = {
        **(live.evidence if isinstance(live.evidence, dict) else {}),
        **data.evidence,
        "recoveryBudget": {
            "state": "exhausted",
            "attemptsUsed": used,
            "maxAttempts": max_attempts,
            "exhaustedAt": db_now_iso(),
            "cause": data.cause,
            "fingerprint": data.fingerprint,
        },
    }
    live.outcome = IssueRecoveryAction.Outcome.ESCALATED
    live.next_action = (
        f"Automatic recovery stopped after {used}/{max_attempts} attempts; "
        "a board member must decide how to continue."
    )
    live.updated_at = Now()
    live.save()
    live.refresh_from_db()
    _audit(live, "escalated", actor_id, attemptsUsed=used, maxAttempts=max_attempts)
    return RecoveryUpsert(live, "escalated")


def _update_live(
    live: IssueRecoveryAction,
    data: RecoveryActionInput,
    *,
    max_attempts: int | None,
    actor_id: str,
) -> RecoveryUpsert:
    """One more attempt of the live action: its evidence merged (the owner kept), or the whole
    action replaced by `data`."""
    next_count = live.attempt_count + 1
    if data.preserve_existing_owner:
        live.evidence = {
            **(live.evidence if isinstance(live.evidence, dict) else {}),
            **data.evidence,
        }
    else:
        live.kind = data.kind
        live.owner_type = data.owner_type or ("agent" if data.owner_agent_id else "board")
        live.owner_agent_id = data.owner_agent_id
        live.owner_user_id = data.owner_user_id
        live.return_owner_agent_id = data.return_owner_agent_id
        live.cause = data.cause
        live.fingerprint = data.fingerprint
        live.evidence = dict(data.evidence)
        live.next_action = data.next_action
        live.wake_policy = data.wake_policy
        live.monitor_policy = data.monitor_policy
        live.max_attempts = max_attempts
        live.outcome = None
        live.resolution_note = None
    live.attempt_count = next_count
    live.last_attempt_at = Now()
    live.updated_at = Now()
    live.save()
    live.refresh_from_db()
    _audit(live, "updated", actor_id, attemptCount=next_count)
    return RecoveryUpsert(live, "updated")


def upsert_source_scoped_in_tx(
    *, company_id: UUID, source_issue_id: UUID, data: RecoveryActionInput, actor_id: str
) -> RecoveryUpsert:
    """The upsert inside the caller's transaction (takes the per-issue advisory lock)."""
    require_transaction()
    advisory_xact_lock(recovery_source_key(company_id, source_issue_id))
    for attempt in range(UNIQUE_RACE_RETRIES + 1):
        try:
            return _upsert_once(
                company_id=company_id,
                source_issue_id=source_issue_id,
                data=data,
                actor_id=actor_id,
            )
        except IntegrityError:
            # A writer that doesn't take our advisory lock won a partial unique index;
            # re-read the live action and decide again.
            if attempt == UNIQUE_RACE_RETRIES:
                raise
            logger.info("recovery action upsert raced a unique index; retrying")
    raise AssertionError("unreachable")  # pragma: no cover


def recovery_action_upsert_source_scoped(
    *,
    company_id: UUID,
    source_issue_id: UUID,
    data: RecoveryActionInput,
    actor_id: str = "recovery",
) -> RecoveryUpsert:
    """Insert, supersede, update or escalate the issue's single live recovery action.

    With `data.held_run_id` (a board hold of that run) the action is the run's own instead:
    its live hold of the same cause is inserted, superseded (an identity change, when asked)
    or updated in place, and no other action of the issue is touched.

    - no live action: insert an active one (attempt 1 unless given);
    - `supersede_on_identity_change` and (cause, fingerprint) differ: cancel the live one and
      insert the new one;
    - the live action's budget is exhausted: return it unchanged (idempotent);
    - the next attempt reaches `max_attempts`: escalate to the board and record
      `evidence.recoveryBudget`;
    - otherwise update in place and count the attempt.

    Locks: advisory key (company, source issue), then the live action row. A unique-index
    race (IntegrityError in a savepoint) is retried up to 3 times. Audited.
    """
    with transaction.atomic(durable=True):
        return upsert_source_scoped_in_tx(
            company_id=company_id, source_issue_id=source_issue_id, data=data, actor_id=actor_id
        )


def resolve_in_tx(
    *,
    action: IssueRecoveryAction,
    status: str,
    outcome: str,
    resolution_note: str,
    actor_type: str,
    actor_id: str,
) -> IssueRecoveryAction:
    """Close a locked live action inside the caller's transaction."""
    require_transaction()
    action.status = status
    action.outcome = outcome
    action.resolution_note = resolution_note
    action.resolved_at = Now()
    action.updated_at = Now()
    action.save(update_fields=["status", "outcome", "resolution_note", "resolved_at", "updated_at"])
    action.refresh_from_db()
    activity_record(
        company_id=action.company_id,
        actor_type=actor_type,
        actor_id=actor_id,
        action="recovery_action.resolved",
        entity_type="issue_recovery_action",
        entity_id=action.pk,
        details={
            "status": status,
            "outcome": outcome,
            "cause": action.cause,
            "resolutionNote": resolution_note,
        },
    )
    return action


def recovery_action_resolve(
    *,
    company_id: UUID,
    source_issue_id: UUID,
    outcome: str,
    resolution_note: str,
    actor_type: str,
    actor_id: str,
    action_id: UUID | None = None,
    cause: str | None = None,
    fingerprint: str | None = None,
    status: str = IssueRecoveryAction.Status.RESOLVED,
) -> IssueRecoveryAction:
    """Resolve (or cancel) the issue's live recovery action, optionally matched by id, cause
    and fingerprint.

    An unverified workspace-owner hold is not dismissable this way: it resolves only when the
    saved result is finalized (RecoveryHoldNotDismissable). Locks: advisory key (company,
    source issue), then the action row. Raises RecoveryActionNotFound. Audited.
    """
    if status not in (IssueRecoveryAction.Status.RESOLVED, IssueRecoveryAction.Status.CANCELLED):
        raise ValueError(f"not a closing status: {status}")
    with transaction.atomic(durable=True):
        advisory_xact_lock(recovery_source_key(company_id, source_issue_id))
        qs = recovery_actions_for_update().filter(
            company_id=company_id, source_issue_id=source_issue_id, status__in=LIVE_STATUSES
        )
        if action_id is not None:
            qs = qs.filter(pk=action_id)
        if cause is not None:
            qs = qs.filter(cause=cause)
        if fingerprint is not None:
            qs = qs.filter(fingerprint=fingerprint)
        action = qs.first()
        if action is None:
            raise RecoveryActionNotFound()
        if action.cause == OWNER_UNVERIFIED_CAUSE:
            raise RecoveryHoldNotDismissable()
        return resolve_in_tx(
            action=action,
            status=status,
            outcome=outcome,
            resolution_note=resolution_note,
            actor_type=actor_type,
            actor_id=actor_id,
        )
