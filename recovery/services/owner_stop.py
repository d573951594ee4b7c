"""Board confirmation that a workspace owner stopped (docs/recovery.md#owner-stop-confirmation)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal
from uuid import UUID

from django.db import transaction
from django.db.models.functions import Now

from paperclip.access import Actor
from paperclip.activity import activity_record
from paperclip.db.advisory import advisory_xact_lock, try_advisory_xact_lock
from paperclip.db.clock import db_now_iso
from paperclip.db.locking import (
    busy_on_lock_timeout,
    require_transaction,
    set_local_lock_timeout,
)
from paperclip.errors import ConflictError, InvalidRequest, NotFoundError
from paperclip.models import HeartbeatRun, Issue, NativeRunFinalization, NativeRunResult
from paperclip.receipts import OWNER_KEY, raw_owner, read_owner
from recovery.adapters.identity import current_controller_identity, evaluate_receipt_takeover
from recovery.errors import (
    WorkspaceControllerAlive,
    WorkspaceCopybackActive,
    WorkspaceOwnerRecoveryStale,
)
from recovery.locks import (
    board_request_key,
    coordinators_for_update,
    finalization_lock_key,
    issues_for_update,
    recovery_actions_for_update,
    runs_for_update,
)
from recovery.models import LIVE_STATUSES, IssueRecoveryAction
from recovery.selectors.actions import OWNER_UNVERIFIED_CAUSE, WAITING_PHASES, run_issue_id
from recovery.services.finalization_jobs import finalization_defer_in_tx
from recovery.takeover import owner_host

MIN_STOP_EVIDENCE_CHARS = 20
MAX_STOP_EVIDENCE_CHARS = 12000
QUEUED_NEXT_ACTION = (
    "Workspace finalization is queued for the saved result; the agent will not repeat its work."
)
# The coordinator may have been waiting in any of these when its owner vanished.
_ADMISSIBLE_PHASES = (*WAITING_PHASES, "retryable_failure")
_CLOSED_ISSUE_STATUSES = ("done", "cancelled")


@dataclass(frozen=True, slots=True)
class OwnerStopConfirmation:
    run_id: UUID
    result_id: UUID
    status: Literal["queued"] = "queued"
    replayed: bool = False  # True for an idempotent repeat: nothing was written


def nonblank_length(text: str) -> int:
    return sum(1 for ch in text if not ch.isspace())


def board_text_problem(text: str) -> str | None:
    """What is wrong with a board member's written attestation (stop evidence, a repair
    note), or None: at least MIN_STOP_EVIDENCE_CHARS non-blank characters, at most
    MAX_STOP_EVIDENCE_CHARS in all. One rule for the services and their API serializers."""
    if nonblank_length(text) < MIN_STOP_EVIDENCE_CHARS:
        return f"At least {MIN_STOP_EVIDENCE_CHARS} non-blank characters."
    if len(text) > MAX_STOP_EVIDENCE_CHARS:
        return f"At most {MAX_STOP_EVIDENCE_CHARS} characters."
    return None


def _replay(
    *,
    action: IssueRecoveryAction | None,
    run: HeartbeatRun | None,
    coordinator: NativeRunFinalization | None,
    run_id: UUID,
    owner_token: str,
) -> OwnerStopConfirmation | None:
    """The earlier answer, if this exact confirmation (same action, run, owner token and saved
    result) was already recorded and its receipt is gone. Never writes, so a repeat can't
    release a newer owner. Safe without row locks: a recorded stop is never removed and a
    released token never comes back (tokens are random per claim)."""
    if action is None or run is None or coordinator is None:
        return None
    evidence: Any = action.evidence
    stop = evidence.get("workspaceOwnerStop") if isinstance(evidence, dict) else None
    if not isinstance(stop, dict) or evidence.get("runId") != str(run_id):
        return None
    owner = stop.get("owner")
    if not isinstance(owner, dict) or owner.get("token") != owner_token:
        return None
    if coordinator.result_id is None or stop.get("resultId") != str(coordinator.result_id):
        return None
    current = raw_owner(run.runner_profile_json)
    if isinstance(current, dict) and current.get("token") == owner_token:
        return None
    return OwnerStopConfirmation(run_id=run_id, result_id=coordinator.result_id, replayed=True)


def _replay_read(
    *, company_id: UUID, issue_id: UUID, action_id: UUID, run_id: UUID, owner_token: str
) -> OwnerStopConfirmation | None:
    """`_replay` on the rows as they are now (read without locks)."""
    return _replay(
        action=IssueRecoveryAction.objects.filter(
            pk=action_id, company_id=company_id, source_issue_id=issue_id
        ).first(),
        run=HeartbeatRun.objects.filter(pk=run_id, company_id=company_id).first(),
        coordinator=NativeRunFinalization.objects.filter(
            run_id=run_id, company_id=company_id, issue_id=issue_id
        ).first(),
        run_id=run_id,
        owner_token=owner_token,
    )


def recovery_owner_stop_confirm(
    *,
    actor: Actor,
    issue_id: UUID,
    action_id: UUID,
    run_id: UUID,
    owner_token: str,
    stop_evidence: str,
    controller_and_copyback_stopped: bool,
) -> OwnerStopConfirmation:
    """A board member attests that the recorded finalization owner of `run_id` (controller and
    copy-back processes) has stopped; release exactly that receipt so the ordinary
    reconciler finalizes the saved result. Changes nothing else.

    Locks, in one transaction: the run's board-request key (`board_request_key`, waited for:
    a duplicate submission overlapping the first waits for it to commit and answers as its
    replay), then `pg_try_advisory_xact_lock` on the run's finalization key (held →
    WorkspaceCopybackActive), then issue → coordinator → run → action FOR NO KEY UPDATE. Rejects
    with WorkspaceOwnerRecoveryStale when the action, run, coordinator, result, issue binding
    or receipt is no longer the recorded one or a newer run exists; WorkspaceControllerAlive
    when the owner is on this host and its process is alive; NotFoundError for an issue the
    actor can't see; InvalidRequest without the checkbox or with short evidence. A repeat is
    idempotent (same answer, nothing written, even while the lock is held). Audited
    (`issue.workspace_owner_stop_confirmed`); the finalization job is deferred in the same
    transaction, explicit (docs/worker.md#finalization-in-the-worker).
    """
    fields: dict[str, list[str]] = {}
    if controller_and_copyback_stopped is not True:
        fields["controller_and_copyback_stopped"] = ["Confirm that the owner has stopped."]
    if (problem := board_text_problem(stop_evidence)) is not None:
        fields["stop_evidence"] = [problem]
    if fields:
        raise InvalidRequest(fields=fields)
    visible = Issue.objects.filter(pk=issue_id).values_list("company_id", flat=True).first()
    if visible is None or not actor.can_access(visible):
        raise NotFoundError()
    company_id: UUID = visible
    # An exact repeat answers the same even while the reconciler it woke holds the lock.
    replay = _replay_read(
        company_id=company_id,
        issue_id=issue_id,
        action_id=action_id,
        run_id=run_id,
        owner_token=owner_token,
    )
    if replay is not None:
        return replay
    with busy_on_lock_timeout(), transaction.atomic(durable=True):
        return _confirm_in_tx(
            actor=actor,
            company_id=company_id,
            issue_id=issue_id,
            action_id=action_id,
            run_id=run_id,
            owner_token=owner_token,
            stop_evidence=stop_evidence,
        )


@dataclass(frozen=True, slots=True)
class HoldBinding:
    """The rows a confirmation reads and writes, locked in the lock order."""

    issue: Issue
    coordinator: NativeRunFinalization
    run: HeartbeatRun
    action: IssueRecoveryAction

    @property
    def evidence(self) -> dict[str, Any]:
        """The hold's evidence (an empty dict when it is not an object)."""
        evidence = self.action.evidence
        return evidence if isinstance(evidence, dict) else {}


def _confirm_in_tx(
    *,
    actor: Actor,
    company_id: UUID,
    issue_id: UUID,
    action_id: UUID,
    run_id: UUID,
    owner_token: str,
    stop_evidence: str,
) -> OwnerStopConfirmation:
    require_transaction()
    set_local_lock_timeout()
    # A double submission waits here for the first to commit, then answers as its replay:
    # checked before the finalization key, which the job the first one queued may hold by now.
    advisory_xact_lock(board_request_key(company_id, run_id))
    replay = _replay_read(
        company_id=company_id,
        issue_id=issue_id,
        action_id=action_id,
        run_id=run_id,
        owner_token=owner_token,
    )
    if replay is not None:
        return replay
    # The same key a live controller holds for the whole copy-back: if we get it, no
    # finalization of this run is in progress anywhere.
    if not try_advisory_xact_lock(finalization_lock_key(company_id, run_id)):
        raise WorkspaceCopybackActive(run_id=str(run_id))
    bound = lock_hold_binding(
        company_id=company_id, issue_id=issue_id, action_id=action_id, run_id=run_id
    )
    result_id = _require_hold_current(bound, company_id=company_id, run_id=run_id)
    raw = _require_owner_stoppable(bound, owner_token=owner_token)
    return _record_confirmation(
        bound,
        actor=actor,
        company_id=company_id,
        result_id=result_id,
        raw_owner=raw,
        stop_evidence=stop_evidence,
    )


def lock_hold_binding(
    *,
    company_id: UUID,
    issue_id: UUID,
    action_id: UUID,
    run_id: UUID,
    stale: type[ConflictError] = WorkspaceOwnerRecoveryStale,
) -> HoldBinding:
    """Lock issue, coordinator, run and recovery action (the lock order); any missing is a
    stale request (`stale`, reason `binding_missing`)."""
    issue = issues_for_update().filter(pk=issue_id, company_id=company_id).first()
    coordinator = (
        coordinators_for_update()
        .filter(run_id=run_id, company_id=company_id, issue_id=issue_id)
        .first()
    )
    run = runs_for_update().filter(pk=run_id, company_id=company_id).first()
    action = (
        recovery_actions_for_update()
        .filter(pk=action_id, company_id=company_id, source_issue_id=issue_id)
        .first()
    )
    if issue is None or coordinator is None or run is None or action is None:
        raise stale(reason="binding_missing")
    return HoldBinding(issue, coordinator, run, action)


def _require_hold_current(bound: HoldBinding, *, company_id: UUID, run_id: UUID) -> UUID:
    """The hold is still the live owner-unverified hold of this run, and the saved result is
    still current (`require_saved_result_current`). Returns the accepted result."""
    action, evidence = bound.action, bound.evidence
    if (
        action.cause != OWNER_UNVERIFIED_CAUSE
        or action.owner_type != IssueRecoveryAction.OwnerType.BOARD
        or action.kind != IssueRecoveryAction.Kind.ACTIVE_RUN_WATCHDOG
        or action.status not in LIVE_STATUSES
        or evidence.get("runId") != str(run_id)
    ):
        raise WorkspaceOwnerRecoveryStale(reason="action_not_current")
    return require_saved_result_current(
        bound, company_id=company_id, phases=_ADMISSIBLE_PHASES, stale=WorkspaceOwnerRecoveryStale
    )


def require_saved_result_current(
    bound: HoldBinding,
    *,
    company_id: UUID,
    phases: tuple[str, ...],
    stale: type[ConflictError],
) -> UUID:
    """The run, its coordinator (in one of `phases`, unowned), the issue and the accepted
    result are all still the ones a board hold was recorded for (a later run of the issue
    changes none of that); otherwise `stale`, naming the first check that failed. Returns the
    accepted result. Shared by the owner-stop confirmation and the export retry."""
    issue, coordinator, run = bound.issue, bound.coordinator, bound.run
    if (
        run.runtime_mode != HeartbeatRun.RuntimeMode.NATIVE
        or run.status != HeartbeatRun.Status.RUNNING
        or run_issue_id(run) != issue.pk
    ):
        raise stale(reason="run_not_current")
    if coordinator.phase not in phases or coordinator.lease_owner or coordinator.result_id is None:
        raise stale(reason="coordinator_not_waiting")
    # A later run of the issue may hold its slots now, or be newer: the held run's saved result
    # still waits for the board all the same (docs/recovery.md#one-hold-per-held-run).
    if issue.status in _CLOSED_ISSUE_STATUSES or issue.assignee_agent_id != run.agent_id:
        raise stale(reason="issue_moved_on")
    if (
        run.completion_contract_id is None
        or not NativeRunResult.objects.filter(
            pk=coordinator.result_id,
            company_id=company_id,
            issue_id=issue.pk,
            run_id=run.pk,
            completion_contract_id=run.completion_contract_id,
            schema_status=NativeRunResult.SchemaStatus.ACCEPTED,
        ).exists()
    ):
        raise stale(reason="result_not_bound")
    return coordinator.result_id


def _require_owner_stoppable(bound: HoldBinding, *, owner_token: str) -> Any:
    """The run's receipt is still the owner the hold recorded (`owner_changed` otherwise) and,
    when it ran on this host and boot, its process is dead (`WorkspaceControllerAlive` otherwise).
    Returns the raw receipt."""
    evidence = bound.evidence
    raw = raw_owner(bound.run.runner_profile_json)
    receipt = read_owner(raw)
    if receipt is None or receipt.token != owner_token or raw != evidence.get("owner"):
        raise WorkspaceOwnerRecoveryStale(reason="owner_changed")
    # Another host, or this host name under another kernel boot: nothing here can be probed,
    # the board's own verification is the evidence (docs/recovery.md#controller-identity).
    if owner_host(receipt, current_controller_identity()) == "this_host":
        decision = evaluate_receipt_takeover(receipt)
        if not decision.allowed:
            raise WorkspaceControllerAlive(
                hostname=receipt.hostname, pid=receipt.pid, reason=decision.reason
            )
    return raw


def _record_confirmation(
    bound: HoldBinding,
    *,
    actor: Actor,
    company_id: UUID,
    result_id: UUID,
    raw_owner: Any,
    stop_evidence: str,
) -> OwnerStopConfirmation:
    """Release the stopped owner's receipt, record the stop on the hold, defer the
    finalization (an explicit request: attempted now, whatever retry time or spent budget the
    coordinator shows) and write the audit row."""
    issue, run, action = bound.issue, bound.run, bound.action
    released = HeartbeatRun.objects.filter(pk=run.pk).update(
        runner_profile_json=_without_owner(run.runner_profile_json), updated_at=Now()
    )
    if released != 1:  # pragma: no cover - the row is locked
        raise WorkspaceOwnerRecoveryStale(reason="owner_changed")
    stop = {
        "owner": raw_owner,
        "resultId": str(result_id),
        "actorId": actor.actor_id,
        "stopEvidence": stop_evidence,
        "confirmedAt": db_now_iso(),
    }
    action.evidence = {**bound.evidence, "workspaceOwnerStop": stop}
    action.next_action = QUEUED_NEXT_ACTION
    action.wake_policy = None
    action.monitor_policy = None
    action.updated_at = Now()
    action.save(
        update_fields=["evidence", "next_action", "wake_policy", "monitor_policy", "updated_at"]
    )
    job_id = finalization_defer_in_tx(company_id=company_id, run_id=run.pk, explicit=True)
    activity_record(
        company_id=company_id,
        actor_type=actor.actor_type,
        actor_id=actor.actor_id,
        action="issue.workspace_owner_stop_confirmed",
        entity_type="issue",
        entity_id=issue.pk,
        run_id=run.pk,
        details={
            "recoveryActionId": str(action.pk),
            "resultId": str(result_id),
            "owner": raw_owner,
            "stopEvidence": stop_evidence,
            "finalizationJobId": job_id,
        },
    )
    return OwnerStopConfirmation(run_id=run.pk, result_id=result_id)


def _without_owner(profile: Any) -> dict[str, Any]:
    # The run row is locked FOR UPDATE and the receipt was compared above, so removing the
    # key from the value we read is exact.
    data = dict(profile) if isinstance(profile, dict) else {}
    data.pop(OWNER_KEY, None)
    return data
