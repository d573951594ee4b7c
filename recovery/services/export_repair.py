"""Workspace export repair (docs/recovery.md#workspace-export-repair): when exporting a run's
saved result into its workspace (publishing its snapshot, or copying its directory back) has
failed through the whole retry budget, the board gets a hold; once the cause is repaired, the
board's "Retry workspace export" queues one more attempt, admitted only while everything the
hold recorded is still current.

The hold is a board-owned recovery action, cause `native_workspace_sync_out_retry_exhausted`,
whose evidence names the run, its accepted result, what the export moves where (the
descriptor), the run's environment lease (sandbox) and the last failure. Opening it also tags
the run's prepared export lease as stop-only (`export_resume_preserve`), so the sandbox is
stopped and kept, never destroyed, while the work is only in it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal
from uuid import UUID

from django.db import transaction
from django.db.models.functions import Now

from leases.environment.export_resume.preserve import export_resume_preserve
from leases.models import EnvironmentLease, WorkspaceRuntimeLease
from paperclip.access import Actor
from paperclip.activity import activity_record
from paperclip.db.advisory import advisory_xact_lock, try_advisory_xact_lock
from paperclip.db.clock import db_now_iso
from paperclip.db.locking import busy_on_lock_timeout, require_transaction, set_local_lock_timeout
from paperclip.errors import InvalidRequest, NotFoundError
from paperclip.models import HeartbeatRun, Issue, NativeRunFinalization
from paperclip.worker.jobs import pending_jobs
from recovery.errors import (
    WorkspaceCopybackActive,
    WorkspaceExportRetryStale,
    WorkspaceExportStopUnconfirmed,
)
from recovery.locks import board_request_key, finalization_lock_key, finalization_queueing_lock
from recovery.models import LIVE_STATUSES, IssueRecoveryAction
from recovery.selectors.exports import (
    EXPORT_RETRY_KEY,
    export_descriptor,
    is_held_export,
    lease_stop_confirmed,
    run_environment_lease,
)
from recovery.services.actions import RecoveryActionInput, upsert_source_scoped_in_tx
from recovery.services.finalization_jobs import finalization_defer_in_tx
from recovery.services.owner_stop import (
    HoldBinding,
    board_text_problem,
    lock_hold_binding,
    require_saved_result_current,
)

EXPORT_REPAIR_CAUSE: Final = "native_workspace_sync_out_retry_exhausted"
EXPORT_REPAIR_ACTOR: Final = "workspace_finalizer"
REPAIR_NEXT_ACTION: Final = (
    "Exporting the saved result into the workspace failed on every attempt. Repair the cause "
    "(the last failure says what: disk space, permissions, the workspace cwd, the sandbox "
    "through its provider), then Retry workspace export with a note on the repair."
)
QUEUED_NEXT_ACTION: Final = (
    "Workspace export is queued for the saved result; the agent will not repeat its work. "
    "The outcome shows in the run's finalization state."
)


def _fingerprint(run_id: UUID, result_id: UUID | None) -> str:
    return f"workspace-export:{run_id}:{result_id}"


def _lease_binding(run: HeartbeatRun) -> dict[str, Any]:
    lease = run_environment_lease(run)
    if lease is None:
        return {"leaseId": None}
    return {
        "leaseId": str(lease.pk),
        "provider": lease.provider,
        "providerLeaseId": lease.provider_lease_id,
    }


def export_hold_in_tx(
    *,
    issue: Issue,
    run: HeartbeatRun,
    coordinator: NativeRunFinalization,
    failure: dict[str, Any],
) -> IssueRecoveryAction:
    """Open (or bring up to date) the board's export-repair hold for the run whose export just
    spent its retry budget, in the caller's transaction. A hold already live for the same
    result records the new failure and makes a new retry admissible again (the earlier
    request moves to `evidence.retries`); nothing else is touched."""
    require_transaction()
    preserved = export_resume_preserve(
        run_id=run.pk,
        result_id=coordinator.result_id,
        actor_type="system",
        actor_id=EXPORT_REPAIR_ACTOR,
    )
    fingerprint = _fingerprint(run.pk, coordinator.result_id)
    upsert = upsert_source_scoped_in_tx(
        company_id=run.company_id,
        source_issue_id=issue.pk,
        data=RecoveryActionInput(
            kind=IssueRecoveryAction.Kind.WORKSPACE_VALIDATION,
            owner_type=IssueRecoveryAction.OwnerType.BOARD,
            return_owner_agent_id=run.agent_id,
            cause=EXPORT_REPAIR_CAUSE,
            fingerprint=fingerprint,
            evidence={
                "runId": str(run.pk),
                "resultId": str(coordinator.result_id),
                "agentId": str(run.agent_id),
                "descriptor": export_descriptor(run, issue, coordinator),
                **_lease_binding(run),
                **({"stopOnlyRequestId": preserved.request_id} if preserved is not None else {}),
                "failure": failure,
            },
            next_action=REPAIR_NEXT_ACTION,
            wake_policy=None,
            preserve_existing_owner=True,
            supersede_on_identity_change=True,
            held_run_id=run.pk,
        ),
        actor_id=EXPORT_REPAIR_ACTOR,
    )
    action = upsert.action
    evidence = action.evidence if isinstance(action.evidence, dict) else {}
    if EXPORT_RETRY_KEY in evidence:
        # The board's retry ran and failed again: keep it in the history and wait for the
        # next repair.
        earlier = evidence.get("retries")
        retries: list[Any] = earlier if isinstance(earlier, list) else []
        evidence = {k: v for k, v in evidence.items() if k != EXPORT_RETRY_KEY}
        evidence["retries"] = [*retries, {**evidence_retry(action), "failure": failure}]
        action.evidence = evidence
        action.next_action = REPAIR_NEXT_ACTION
        action.updated_at = Now()
        action.save(update_fields=["evidence", "next_action", "updated_at"])
    return action


def evidence_retry(action: IssueRecoveryAction) -> dict[str, Any]:
    """The board's queued retry recorded on the hold (empty when none waits)."""
    evidence = action.evidence if isinstance(action.evidence, dict) else {}
    retry = evidence.get(EXPORT_RETRY_KEY)
    return retry if isinstance(retry, dict) else {}


@dataclass(frozen=True, slots=True)
class ExportRetry:
    run_id: UUID
    result_id: UUID
    lease_id: UUID | None
    status: Literal["queued"] = "queued"
    replayed: bool = False  # an idempotent repeat: nothing was written


def _replay(action: IssueRecoveryAction | None, *, run_id: UUID) -> ExportRetry | None:
    """The earlier answer when this hold already has a retry queued for its saved result
    (whatever the note) and that retry still stands: the run committed, or a finalization job
    of the run still waits or runs. A duplicate request writes nothing. A recorded retry whose
    job ended without either (its worker died and the run was held again for its owner) is
    no answer: the request goes on to the locked checks, which say what the run waits for."""
    if action is None:
        return None
    evidence = action.evidence if isinstance(action.evidence, dict) else {}
    retry = evidence_retry(action)
    if evidence.get("runId") != str(run_id) or not retry:
        return None
    if retry.get("resultId") != evidence.get("resultId"):
        return None
    committed = NativeRunFinalization.objects.filter(
        run_id=run_id, company_id=action.company_id, phase=NativeRunFinalization.Phase.COMMITTED
    ).exists()
    if not committed and not pending_jobs(finalization_queueing_lock(run_id)):
        return None
    lease_id = retry.get("leaseId")
    return ExportRetry(
        run_id=run_id,
        result_id=UUID(str(retry["resultId"])),
        lease_id=UUID(lease_id) if isinstance(lease_id, str) else None,
        replayed=True,
    )


def _replay_read(
    *, company_id: UUID, issue_id: UUID, action_id: UUID, run_id: UUID
) -> ExportRetry | None:
    """`_replay` on the hold as it is now (read without locks)."""
    action = IssueRecoveryAction.objects.filter(
        pk=action_id, company_id=company_id, source_issue_id=issue_id, cause=EXPORT_REPAIR_CAUSE
    ).first()
    return _replay(action, run_id=run_id)


def workspace_export_retry(
    *, actor: Actor, issue_id: UUID, action_id: UUID, run_id: UUID, repair_note: str
) -> ExportRetry:
    """The board repaired what made the run's export fail: queue one more export attempt of
    the saved result.

    Admitted only while the hold is live and everything it recorded is current: the same
    accepted result, task owner (the issue still assigned to the run's agent, the run its
    execution run), descriptor (the same tree or directory into the same `cwd`) and
    environment lease; the provider confirmed the sandbox stopped
    (WorkspaceExportStopUnconfirmed otherwise); no newer run of the issue and no competing
    lease (another owner's unexpired runtime lease on the workspace, or another active lease
    of the same sandbox). Anything else is WorkspaceExportRetryStale naming the check;
    WorkspaceCopybackActive while an attempt holds the finalization lock; NotFoundError for
    an issue the actor can't see; InvalidRequest for a short note. A repeat while the retry
    is queued answers the same and writes nothing; one submitted while the first is still in
    its transaction waits for it (the run's board-request key, taken before the
    finalization key) and answers the same. The hold stays live until the export
    commits (which resolves it) or fails again (which asks for the next repair).

    Writes, in one transaction: the request on the hold's evidence, its next action, the
    finalization job (explicit: attempted although the budget is spent) and the audit row
    `issue.workspace_export_retry_requested`.
    """
    if (problem := board_text_problem(repair_note)) is not None:
        raise InvalidRequest(fields={"repair_note": [problem]})
    company_id = Issue.objects.filter(pk=issue_id).values_list("company_id", flat=True).first()
    if company_id is None or not actor.can_access(company_id):
        raise NotFoundError()
    # A repeat answers the same even while the attempt it queued holds the lock.
    replay = _replay_read(
        company_id=company_id, issue_id=issue_id, action_id=action_id, run_id=run_id
    )
    if replay is not None:
        return replay
    with busy_on_lock_timeout(), transaction.atomic(durable=True):
        set_local_lock_timeout()
        # A double submission waits here for the first to commit, then answers as its replay:
        # checked before the finalization key, which the attempt the first one queued may hold.
        advisory_xact_lock(board_request_key(company_id, run_id))
        replay = _replay_read(
            company_id=company_id, issue_id=issue_id, action_id=action_id, run_id=run_id
        )
        if replay is not None:
            return replay
        if not try_advisory_xact_lock(finalization_lock_key(company_id, run_id)):
            raise WorkspaceCopybackActive(run_id=str(run_id))
        bound = lock_hold_binding(
            company_id=company_id,
            issue_id=issue_id,
            action_id=action_id,
            run_id=run_id,
            stale=WorkspaceExportRetryStale,
        )
        result_id = _require_export_hold_current(bound, company_id=company_id, run_id=run_id)
        lease = _require_lease_current(bound)
        return _record_retry(
            bound,
            actor=actor,
            company_id=company_id,
            result_id=result_id,
            lease=lease,
            repair_note=repair_note,
        )


def _require_export_hold_current(bound: HoldBinding, *, company_id: UUID, run_id: UUID) -> UUID:
    action, evidence = bound.action, bound.evidence
    stale = WorkspaceExportRetryStale
    if (
        not is_held_export(action)
        or action.owner_type != IssueRecoveryAction.OwnerType.BOARD
        or action.status not in LIVE_STATUSES
        or evidence.get("runId") != str(run_id)
    ):
        raise stale(reason="action_not_current")
    result_id = require_saved_result_current(
        bound,
        company_id=company_id,
        phases=(NativeRunFinalization.Phase.RETRYABLE_FAILURE,),
        stale=stale,
    )
    if evidence.get("resultId") != str(result_id):
        raise stale(reason="result_changed")
    if evidence.get("descriptor") != export_descriptor(bound.run, bound.issue, bound.coordinator):
        raise stale(reason="descriptor_changed")
    workspace_id = bound.run.execution_workspace_id or bound.issue.execution_workspace_id
    competing_runtime = WorkspaceRuntimeLease.objects.filter(
        execution_workspace_id=workspace_id, expires_at__gt=Now()
    ).exclude(owner_run_id=run_id)
    if workspace_id is not None and competing_runtime.exists():
        raise stale(reason="competing_lease")
    return result_id


def _require_lease_current(bound: HoldBinding) -> EnvironmentLease | None:
    """The environment lease the hold recorded is still the run's and its stop is confirmed:
    a stop receipt bound to it for a remote sandbox, retired for a local one."""
    evidence = bound.evidence
    recorded = evidence.get("leaseId")
    current = run_environment_lease(bound.run)
    if recorded is None:
        if current is not None:
            raise WorkspaceExportRetryStale(reason="lease_changed")
        return None
    if (
        current is None
        or str(current.pk) != recorded
        or current.provider_lease_id != evidence.get("providerLeaseId")
        or current.provider != evidence.get("provider")
    ):
        raise WorkspaceExportRetryStale(reason="lease_changed")
    if current.provider_lease_id:
        competing = (
            EnvironmentLease.objects.filter(
                provider=current.provider,
                provider_lease_id=current.provider_lease_id,
                status=EnvironmentLease.Status.ACTIVE,
            )
            .exclude(pk=current.pk)
            .exists()
        )
        if competing:
            raise WorkspaceExportRetryStale(reason="competing_lease")
    if not lease_stop_confirmed(current):
        raise WorkspaceExportStopUnconfirmed(
            lease_id=str(current.pk),
            lease_status=current.status,
            cleanup_status=current.cleanup_status,
        )
    return current


def _record_retry(
    bound: HoldBinding,
    *,
    actor: Actor,
    company_id: UUID,
    result_id: UUID,
    lease: EnvironmentLease | None,
    repair_note: str,
) -> ExportRetry:
    action, run = bound.action, bound.run
    retry = {
        "resultId": str(result_id),
        "leaseId": str(lease.pk) if lease is not None else None,
        "repairNote": repair_note,
        "actorId": actor.actor_id,
        "requestedAt": db_now_iso(),
    }
    action.evidence = {**bound.evidence, EXPORT_RETRY_KEY: retry}
    action.next_action = QUEUED_NEXT_ACTION
    action.updated_at = Now()
    action.save(update_fields=["evidence", "next_action", "updated_at"])
    job_id = finalization_defer_in_tx(company_id=company_id, run_id=run.pk, explicit=True)
    activity_record(
        company_id=company_id,
        actor_type=actor.actor_type,
        actor_id=actor.actor_id,
        action="issue.workspace_export_retry_requested",
        entity_type="issue",
        entity_id=bound.issue.pk,
        run_id=run.pk,
        details={
            "recoveryActionId": str(action.pk),
            "resultId": str(result_id),
            "leaseId": retry["leaseId"],
            "repairNote": repair_note,
            "finalizationJobId": job_id,
        },
    )
    return ExportRetry(
        run_id=run.pk, result_id=result_id, lease_id=lease.pk if lease is not None else None
    )
