"""Accepting a native run's result and finalizing its workspace under ownership."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Literal
from uuid import UUID, uuid4

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.db.models.functions import Now

from paperclip.activity import activity_record
from paperclip.db.advisory import advisory_lock_held
from paperclip.db.locking import require_transaction
from paperclip.errors import DomainError
from paperclip.models import (
    ExecutionWorkspace,
    HeartbeatRun,
    Issue,
    NativeRunFinalization,
    NativeRunResult,
    RunSnapshot,
    WorkspaceOperation,
)
from paperclip.observability import metrics
from paperclip.receipts import raw_owner
from paperclip.services import issue_slots_release_in_tx, run_finish_in_tx
from paperclip.snapshots.adopt import CwdUnadoptable, workspace_cwd_adopt
from paperclip.snapshots.head import (
    HeadMoved,
    PublishError,
    PublishPlan,
    head_publish_in_tx,
    publish_plan,
)
from recovery.adapters.copyback import CopybackError, CopybackReport, copyback_backend
from recovery.canonical import canonical_sha256
from recovery.errors import (
    FinalizationBindingMissing,
    FinalizationNotReady,
    FinalizationOwnershipLost,
    NativeResultConflict,
    RunNotFinalizable,
    SnapshotNotRegistered,
    WorkspaceCopybackNotAllowed,
)
from recovery.locks import (
    coordinators_for_update,
    finalization_lock_key,
    issues_for_update,
    recovery_actions_for_update,
    runs_for_update,
)
from recovery.models import LIVE_STATUSES, IssueRecoveryAction
from recovery.selectors.actions import (
    HEAD_CONFLICT_CODE,
    OWNER_UNVERIFIED_CAUSE,
    WAITING_PHASES,
    finalizations_waiting,
    run_issue_id,
)
from recovery.selectors.exports import (
    HELD_EXPORT,
    result_workspace_tree,
    workspace_destination,
    workspace_dir,
)
from recovery.selectors.finalization import owner_hold_live
from recovery.services.actions import resolve_in_tx
from recovery.services.conflict_resolution import resolution_plan
from recovery.services.conflicts import ConflictDecision, conflict_hold_in_tx, conflict_mode
from recovery.services.copyback_guard import REFUSAL_TEXT, copyback_source_refusal
from recovery.services.export_repair import export_hold_in_tx
from recovery.services.finalization_jobs import finalization_defer_in_tx
from recovery.services.ownership.acquire import with_finalization_ownership
from recovery.services.ownership.lock_connection import FinalizationOwnership
from recovery.services.ownership.outcomes import Acquired, NotAcquired

logger = logging.getLogger(__name__)

TERMINAL_SCHEMA = "paperclip.prp.terminal.v1"
FINALIZER = "native_workspace_finalizer"
RETRY_BASE_SECONDS = 30
RETRY_CAP_SECONDS = 900
# Plans made again when other runs keep moving the head between a plan and its commit.
MAX_HEAD_RACES = 5


@dataclass(frozen=True, slots=True)
class ResultAcceptance:
    result: NativeRunResult
    created: bool  # False for an idempotent repeat


@dataclass(frozen=True, slots=True)
class FinalizeOutcome:
    run_id: UUID
    status: Literal[
        "committed", "already_committed", "retry_scheduled", "retry_exhausted", "not_due", "held"
    ]
    phase: str
    result_id: UUID | None
    run_status: str
    operation_id: UUID | None = None
    copied: CopybackReport | None = None
    failure_code: str | None = None
    published: PublishPlan | None = None


@dataclass(frozen=True, slots=True)
class ReconcileSummary:
    examined: int = 0
    deferred: int = 0
    already_queued: int = 0
    skipped_busy: int = 0
    skipped_held: int = 0


def _run_phase_mirror(
    run: HeartbeatRun, phase: str, *, also: Sequence[str] = (), touch: bool = True
) -> None:
    """The run mirrors its coordinator's phase: `native_phase` (with when it moved) and
    `result_json.finalizationPhase`, which readers of the run alone look at. `also`: more
    fields the caller set on `run`; `touch`: bump `updated_at` too."""
    run.native_phase = phase
    run.native_phase_updated_at = Now()
    run.result_json = {
        **(run.result_json if isinstance(run.result_json, dict) else {}),
        "finalizationPhase": str(phase),
    }
    fields = ["native_phase", "native_phase_updated_at", "result_json", *also]
    if touch:
        run.updated_at = Now()
        fields.append("updated_at")
    run.save(update_fields=fields)


def _max_attempts() -> int:
    return int(getattr(settings, "PAPERCLIP_FINALIZE_MAX_ATTEMPTS", 5))


def _locked_binding(
    *, company_id: UUID, run_id: UUID
) -> tuple[Issue, NativeRunFinalization | None, HeartbeatRun]:
    """Lock issue → coordinator → run (the global order) for a native run with an issue."""
    require_transaction()
    run = HeartbeatRun.objects.filter(pk=run_id, company_id=company_id, runtime_mode="native")
    probe = run.only("id", "native_issue_id", "issue_id", "context_snapshot").first()
    issue_id = run_issue_id(probe) if probe is not None else None
    if probe is None or issue_id is None:
        raise FinalizationBindingMissing(run_id=str(run_id))
    issue = issues_for_update().filter(pk=issue_id, company_id=company_id).first()
    coordinator = coordinators_for_update().filter(run_id=run_id, company_id=company_id).first()
    locked_run = runs_for_update().filter(pk=run_id, company_id=company_id).first()
    if issue is None or locked_run is None:
        raise FinalizationBindingMissing(run_id=str(run_id))
    return issue, coordinator, locked_run


def _require_receipt(run: HeartbeatRun, ownership: FinalizationOwnership) -> None:
    """Fence a write on the locked run row: our receipt must still be the run's receipt, so
    nothing is published after ownership moved on (the row lock keeps it stable until
    commit)."""
    receipt = raw_owner(run.runner_profile_json)
    if not isinstance(receipt, dict) or receipt.get("token") != ownership.token:
        raise FinalizationOwnershipLost("owner_replaced")


def result_accept(
    *,
    company_id: UUID,
    run_id: UUID,
    agent_id: UUID,
    result: dict[str, Any],
    run_terminal_state: str,
    caller_result_id: str | None = None,
    workspace_tree: str | None = None,
) -> ResultAcceptance:
    """Accept the runner's result for a native run and queue its workspace finalization.

    Stores `{result, terminal: {schema, runTerminalState}}` with sha256 fingerprints of its
    canonical JSON; moves the coordinator (created if missing) to `result_accepted` and
    mirrors the phase on the run. Idempotent on `caller_result_id` (and on identical content).
    With `workspace_tree` (a snapshot this run registered, else SnapshotNotRegistered),
    finalization publishes that tree instead of copying a directory back
    (docs/snapshots.md#publishing).
    Without `workspace_tree`, the run's `workspace_dir` (if any) will be copied back, so it
    must pass the copy-back guard (recovery.services.copyback_guard), else
    WorkspaceCopybackNotAllowed(reason) and nothing is written.
    Locks issue → coordinator → run. Raises FinalizationBindingMissing, RunNotFinalizable
    (run terminal or already committed), NativeResultConflict (another result was accepted,
    or the same caller id was used for different content). Audited; the finalization job is
    deferred in the same transaction (docs/worker.md#finalization-in-the-worker).
    """
    if run_terminal_state not in HeartbeatRun.TERMINAL_STATUSES:
        raise ValueError(f"unknown run terminal state {run_terminal_state!r}")
    result_json: dict[str, Any] = {
        "result": result,
        "terminal": {"schema": TERMINAL_SCHEMA, "runTerminalState": run_terminal_state},
    }
    if workspace_tree is not None:
        result_json["workspaceTree"] = workspace_tree
    canonical = canonical_sha256(result_json)
    fingerprint = canonical_sha256({"runId": str(run_id), "resultJson": result_json})
    with transaction.atomic(durable=True):
        issue, coordinator, run = _locked_binding(company_id=company_id, run_id=run_id)
        if run.agent_id != agent_id:
            raise FinalizationBindingMissing(run_id=str(run_id))
        if (
            workspace_tree is not None
            and not RunSnapshot.objects.filter(run_id=run_id, tree=workspace_tree).exists()
        ):
            raise SnapshotNotRegistered(workspace_tree=workspace_tree)
        existing = None
        if caller_result_id is not None:
            existing = NativeRunResult.objects.filter(
                run_id=run_id, caller_result_id=caller_result_id
            ).first()
            if existing is not None and existing.server_fingerprint != fingerprint:
                raise NativeResultConflict(caller_result_id=caller_result_id)
        if existing is None:
            existing = NativeRunResult.objects.filter(
                run_id=run_id, server_fingerprint=fingerprint
            ).first()
        if (
            existing is not None
            and coordinator is not None
            and coordinator.result_id == existing.pk
        ):
            return ResultAcceptance(existing, created=False)
        if coordinator is not None and coordinator.result_id is not None:
            raise NativeResultConflict(accepted_result_id=str(coordinator.result_id))
        if run.is_terminal or (coordinator is not None and coordinator.phase != "observed"):
            raise RunNotFinalizable(status=run.status)
        source = workspace_dir(run)
        if (
            workspace_tree is None
            and source is not None
            and (refusal := copyback_source_refusal(source)) is not None
        ):
            raise WorkspaceCopybackNotAllowed(reason=refusal)
        if run.completion_contract_id is None:
            # A result row needs a completion contract; runs created without one get theirs
            # minted here, under the run lock.
            run.completion_contract_id = uuid4()
        accepted = existing
        if accepted is None:
            try:
                with transaction.atomic():
                    accepted = NativeRunResult.objects.create(
                        company_id=company_id,
                        issue_id=issue.pk,
                        run_id=run_id,
                        completion_contract_id=run.completion_contract_id,
                        caller_result_id=caller_result_id,
                        server_fingerprint=fingerprint,
                        schema_status=NativeRunResult.SchemaStatus.ACCEPTED,
                        result_json=result_json,
                        canonical_sha256=canonical,
                    )
            except IntegrityError as exc:
                raise NativeResultConflict(caller_result_id=caller_result_id) from exc
        if coordinator is None:
            coordinator = NativeRunFinalization(run_id=run_id, company_id=company_id)
        coordinator.issue_id = issue.pk
        coordinator.phase = NativeRunFinalization.Phase.RESULT_ACCEPTED
        coordinator.result_id = accepted.pk
        coordinator.next_attempt_at = None
        coordinator.updated_at = Now()
        coordinator.save()
        _run_phase_mirror(
            run, NativeRunFinalization.Phase.RESULT_ACCEPTED, also=["completion_contract_id"]
        )
        job_id = finalization_defer_in_tx(company_id=company_id, run_id=run_id)
        activity_record(
            company_id=company_id,
            actor_type="agent",
            actor_id=str(agent_id),
            action="run.native_result_accepted",
            entity_type="heartbeat_run",
            entity_id=run_id,
            run_id=run_id,
            details={
                "resultId": str(accepted.pk),
                "callerResultId": caller_result_id,
                "runTerminalState": run_terminal_state,
                "workspaceTree": workspace_tree,
                "finalizationJobId": job_id,
            },
        )
    accepted.refresh_from_db()
    return ResultAcceptance(accepted, created=True)


# --- finalization under ownership ---------------------------------------------------------


def _terminal_state(result: NativeRunResult | None) -> str:
    data = result.result_json if result is not None else None
    terminal = data.get("terminal") if isinstance(data, dict) else None
    state = terminal.get("runTerminalState") if isinstance(terminal, dict) else None
    return state if state in HeartbeatRun.TERMINAL_STATUSES else "succeeded"


def _start_operation(
    *,
    ownership: FinalizationOwnership,
    run: HeartbeatRun,
    issue: Issue,
    source: str | None,
    destination: str | None,
    command: str = "copy-back",
    observation: str | None = None,
) -> WorkspaceOperation:
    """Record `workspace_finalize` (running) and move the coordinator to workspace_finalizing."""
    with transaction.atomic(durable=True):
        issue, coordinator, locked = _locked_binding(company_id=run.company_id, run_id=run.pk)
        _require_receipt(locked, ownership)
        if coordinator is None or coordinator.phase not in (*WAITING_PHASES, "retryable_failure"):
            raise FinalizationNotReady(run_id=str(run.pk))
        # A `running` row left by an earlier owner is not a barrier and never will be: that
        # owner was verified gone before we could claim the receipt. Close it as abandoned so
        # operators see no phantom copy-back in progress.
        abandoned = list(
            WorkspaceOperation.objects.filter(
                company_id=run.company_id,
                heartbeat_run_id=run.pk,
                phase=WorkspaceOperation.PHASE_WORKSPACE_FINALIZE,
                status=WorkspaceOperation.Status.RUNNING,
            ).values_list("pk", flat=True)
        )
        if abandoned:
            with transaction.get_connection().cursor() as cursor:
                cursor.execute(
                    "UPDATE workspace_operations SET status = %s, finished_at = now(), "
                    "updated_at = now(), metadata = coalesce(metadata, '{}'::jsonb) || "
                    '\'{"error": "abandoned_by_previous_owner"}\'::jsonb '
                    "WHERE id = ANY(%s) AND status = %s",
                    [
                        WorkspaceOperation.Status.FAILED,
                        abandoned,
                        WorkspaceOperation.Status.RUNNING,
                    ],
                )
            activity_record(
                company_id=run.company_id,
                actor_type="system",
                actor_id=FINALIZER,
                action="run.workspace_finalize_abandoned",
                entity_type="heartbeat_run",
                entity_id=run.pk,
                run_id=run.pk,
                details={"operationIds": [str(pk) for pk in abandoned]},
            )
        coordinator.phase = NativeRunFinalization.Phase.WORKSPACE_FINALIZING
        coordinator.attempt += 1
        coordinator.updated_at = Now()
        coordinator.save(update_fields=["phase", "attempt", "updated_at"])
        _run_phase_mirror(locked, NativeRunFinalization.Phase.WORKSPACE_FINALIZING, touch=False)
        operation = WorkspaceOperation.objects.create(
            company_id=run.company_id,
            execution_workspace_id=run.execution_workspace_id or issue.execution_workspace_id,
            heartbeat_run_id=run.pk,
            actor_run_id=run.pk,
            issue_id=issue.pk,
            phase=WorkspaceOperation.PHASE_WORKSPACE_FINALIZE,
            command=command,
            cwd=destination,
            status=WorkspaceOperation.Status.RUNNING,
            metadata={
                "owningService": FINALIZER,
                "observation": observation
                or ("workspace_directory" if source else "no_workspace_directory"),
                "source": source,
                "destination": destination,
                "ownerToken": ownership.token,
                "attempt": coordinator.attempt,
            },
        )
        activity_record(
            company_id=run.company_id,
            actor_type="system",
            actor_id=FINALIZER,
            action="run.workspace_finalize_started",
            entity_type="workspace_operation",
            entity_id=operation.pk,
            run_id=run.pk,
            details={"attempt": coordinator.attempt, "source": source, "destination": destination},
        )
    return operation


def _finish_operation(
    *, operation: WorkspaceOperation, succeeded: bool, metadata: dict[str, Any]
) -> None:
    with transaction.atomic(durable=True):
        _finish_operation_in_tx(operation=operation, succeeded=succeeded, metadata=metadata)


def _finish_operation_in_tx(
    *, operation: WorkspaceOperation, succeeded: bool, metadata: dict[str, Any]
) -> None:
    require_transaction()
    updated = WorkspaceOperation.objects.filter(
        pk=operation.pk, status=WorkspaceOperation.Status.RUNNING
    ).update(
        status=WorkspaceOperation.Status.SUCCEEDED
        if succeeded
        else WorkspaceOperation.Status.FAILED,
        exit_code=0 if succeeded else 1,
        finished_at=Now(),
        updated_at=Now(),
        metadata={**(operation.metadata or {}), **metadata},
    )
    if updated:
        activity_record(
            company_id=operation.company_id,
            actor_type="system",
            actor_id=FINALIZER,
            action="run.workspace_finalize_succeeded"
            if succeeded
            else "run.workspace_finalize_failed",
            entity_type="workspace_operation",
            entity_id=operation.pk,
            run_id=operation.heartbeat_run_id,
            details=metadata,
        )


def _schedule_retry(
    *,
    ownership: FinalizationOwnership,
    company_id: UUID,
    run_id: UUID,
    code: str,
    detail: str,
    final: bool = False,
) -> FinalizeOutcome:
    """A copy-back failure keeps the saved result: back off, and after the budget stop
    automatic retries (phase retryable_failure) until someone finalizes it explicitly.
    `final`: a failure no retry can mend (the copy-back guard refused the directory) spends
    the budget at once, under its own code, and goes to the board's hold."""
    with transaction.atomic(durable=True):
        _issue, coordinator, run = _locked_binding(company_id=company_id, run_id=run_id)
        if coordinator is None:
            raise FinalizationNotReady(run_id=str(run_id))
        _require_receipt(run, ownership)
        if coordinator.phase == NativeRunFinalization.Phase.COMMITTED:
            # A committed coordinator is never overwritten by a late failure.
            return _outcome(coordinator, run, "already_committed")
        exhausted = final or coordinator.attempt >= _max_attempts()
        delay = min(RETRY_BASE_SECONDS * 2 ** max(coordinator.attempt - 1, 0), RETRY_CAP_SECONDS)
        coordinator.failure_code = (
            code
            if final
            else "workspace_copyback_retry_exhausted"
            if exhausted
            else "workspace_copyback_failed"
        )
        coordinator.failure_detail = {
            "workspaceFinalizeAttempt": coordinator.attempt,
            "code": code,
            "detail": detail[:2000],
        }
        coordinator.phase = (
            NativeRunFinalization.Phase.RETRYABLE_FAILURE
            if exhausted
            else NativeRunFinalization.Phase.WORKSPACE_FINALIZING
        )
        coordinator.next_attempt_at = None if exhausted else Now() + timedelta(seconds=delay)
        if exhausted:
            # The board gets a hold to repair the cause and retry the export
            # (docs/recovery.md#workspace-export-repair).
            hold = export_hold_in_tx(
                issue=_issue,
                run=run,
                coordinator=coordinator,
                failure={"code": code, "detail": detail[:2000], "attempts": coordinator.attempt},
            )
            coordinator.failure_detail["recoveryActionId"] = str(hold.pk)
        coordinator.updated_at = Now()
        coordinator.save()
        activity_record(
            company_id=company_id,
            actor_type="system",
            actor_id=FINALIZER,
            action="run.workspace_finalize_retry_exhausted"
            if exhausted
            else "run.workspace_finalize_retry_scheduled",
            entity_type="heartbeat_run",
            entity_id=run_id,
            run_id=run_id,
            details=coordinator.failure_detail,
        )
        coordinator.refresh_from_db()
        return _outcome(
            coordinator,
            run,
            "retry_exhausted" if exhausted else "retry_scheduled",
            failure_code=coordinator.failure_code,
        )


def _attempt_failed(
    ownership: FinalizationOwnership,
    *,
    operation: WorkspaceOperation,
    code: str,
    exc: Exception,
    final: bool = False,
) -> FinalizeOutcome:
    """A copy-back or publish attempt failed: close its operation with the error and keep the
    saved result for a retry (the same for both ways a run's work reaches its workspace);
    `final`: no retry, the board's hold at once (see _schedule_retry)."""
    _finish_operation(
        operation=operation, succeeded=False, metadata={"error": code, "detail": str(exc)}
    )
    return _schedule_retry(
        ownership=ownership,
        company_id=ownership.company_id,
        run_id=ownership.run_id,
        code=code,
        detail=str(exc),
        final=final,
    )


def _outcome(
    coordinator: NativeRunFinalization,
    run: HeartbeatRun,
    status: Any,
    *,
    operation_id: UUID | None = None,
    copied: CopybackReport | None = None,
    failure_code: str | None = None,
) -> FinalizeOutcome:
    return FinalizeOutcome(
        run_id=run.pk,
        status=status,
        phase=coordinator.phase,
        result_id=coordinator.result_id,
        run_status=run.status,
        operation_id=operation_id,
        copied=copied,
        failure_code=failure_code,
    )


def _commit(
    *,
    ownership: FinalizationOwnership,
    company_id: UUID,
    run_id: UUID,
    operation_id: UUID | None,
    copied: CopybackReport | None,
    publish: PublishPlan | None = None,
    operation: WorkspaceOperation | None = None,
) -> FinalizeOutcome:
    """Coordinator and run → committed, the run reaches its terminal status, the issue's
    execution lock is cleared and the owner-unverified hold (if any) resolves. With `publish`,
    the workspace head moves in this same transaction (HeadMoved when another run moved it
    since the plan) and `operation` is marked succeeded with it; after a local copy-back
    (`copied`), the cwd no longer holds any tree of the store."""
    with transaction.atomic(durable=True):
        issue, coordinator, run = _locked_binding(company_id=company_id, run_id=run_id)
        if coordinator is None:
            raise FinalizationNotReady(run_id=str(run_id))
        # Fence inside the transaction: the run row is locked, so our receipt can't change
        # between this check and the commit.
        _require_receipt(run, ownership)
        if coordinator.phase == NativeRunFinalization.Phase.COMMITTED:
            return _outcome(coordinator, run, "already_committed")
        if publish is not None:
            head_publish_in_tx(company_id=company_id, run_id=run_id, plan=publish)
            if operation is not None:
                _finish_operation_in_tx(
                    operation=operation, succeeded=True, metadata={"published": publish.as_json()}
                )
        elif copied is not None and (workspace_id := _workspace_id(run, issue)) is not None:
            ExecutionWorkspace.objects.filter(pk=workspace_id).update(cwd_tree=None)
        result = (
            NativeRunResult.objects.filter(pk=coordinator.result_id).first()
            if coordinator.result_id is not None
            else None
        )
        previous_status = run.status
        coordinator.phase = NativeRunFinalization.Phase.COMMITTED
        coordinator.next_attempt_at = None
        coordinator.failure_code = None
        coordinator.failure_detail = None
        coordinator.updated_at = Now()
        coordinator.save()
        _run_phase_mirror(run, NativeRunFinalization.Phase.COMMITTED)
        # The run's own lifecycle step (terminal status, freeing the issue's execution and
        # checkout slots, its status_changed audit row) is the core service's, shared with PATCH.
        if not run.is_terminal:
            issue_lock_cleared = run_id in (
                issue.execution_run_id,
                issue.checkout_run_id,
            )
            run_finish_in_tx(
                run=run,
                to_status=_terminal_state(result),
                actor_type="system",
                actor_id=FINALIZER,
                details={"resultId": str(coordinator.result_id), "via": "finalization"},
            )
        else:
            issue_lock_cleared = issue_slots_release_in_tx(run_id=run_id)
        activity_record(
            company_id=company_id,
            actor_type="system",
            actor_id=FINALIZER,
            action="run.finalization_committed",
            entity_type="heartbeat_run",
            entity_id=run_id,
            run_id=run_id,
            details={
                "resultId": str(coordinator.result_id),
                "fromStatus": previous_status,
                "toStatus": run.status,
                "operationId": str(operation_id) if operation_id else None,
                "issueLockCleared": issue_lock_cleared,
            },
        )
        holds = recovery_actions_for_update().filter(
            Q(cause=OWNER_UNVERIFIED_CAUSE) | HELD_EXPORT,
            company_id=company_id,
            source_issue_id=issue.pk,
            status__in=LIVE_STATUSES,
            evidence__runId=str(run_id),
        )
        for hold in holds:
            resolve_in_tx(
                action=hold,
                status=IssueRecoveryAction.Status.RESOLVED,
                outcome=IssueRecoveryAction.Outcome.RESTORED,
                resolution_note="Workspace finalization committed the saved result.",
                actor_type="system",
                actor_id=FINALIZER,
            )
        run.refresh_from_db()
        coordinator.refresh_from_db()
        outcome = _outcome(coordinator, run, "committed", operation_id=operation_id, copied=copied)
        return replace(outcome, published=publish)


def _not_due(run_id: UUID) -> bool:
    """The coordinator no longer waits for an automatic attempt: it moved past the waiting
    phases or its retry time (database clock) is still ahead."""
    waiting = NativeRunFinalization.objects.filter(run_id=run_id, phase__in=WAITING_PHASES)
    due = waiting.filter(Q(next_attempt_at__isnull=True) | Q(next_attempt_at__lte=Now()))
    return waiting.exists() and not due.exists()


def _finalize_owned(ownership: FinalizationOwnership, *, due_only: bool) -> FinalizeOutcome:
    company_id, run_id = ownership.company_id, ownership.run_id
    run = (
        HeartbeatRun.objects.select_related("execution_workspace")
        .filter(pk=run_id, company_id=company_id)
        .first()
    )
    coordinator = NativeRunFinalization.objects.filter(run_id=run_id).first()
    if run is None:
        raise FinalizationBindingMissing(run_id=str(run_id))
    if coordinator is not None and coordinator.phase == NativeRunFinalization.Phase.COMMITTED:
        return _outcome(coordinator, run, "already_committed")
    if (
        coordinator is None
        or coordinator.result_id is None
        or coordinator.phase not in (*WAITING_PHASES, "retryable_failure")
    ):
        raise FinalizationNotReady(run_id=str(run_id))
    if due_only and (coordinator.phase not in WAITING_PHASES or _not_due(run_id)):
        # Rechecked under ownership (docs/recovery.md#reconciliation-of-finalizations): another
        # reconciler may have attempted it and scheduled a retry since our sweep selected it. Spend
        # nothing.
        return _outcome(coordinator, run, "not_due")
    issue = Issue.objects.select_related("execution_workspace").get(pk=coordinator.issue_id)
    tree = result_workspace_tree(coordinator.result_id)
    if tree is not None:
        return _publish_owned(ownership, run=run, issue=issue, coordinator=coordinator, tree=tree)
    barrier = WorkspaceOperation.objects.filter(
        company_id=company_id,
        heartbeat_run_id=run_id,
        issue_id=issue.pk,
        phase=WorkspaceOperation.PHASE_WORKSPACE_FINALIZE,
        status=WorkspaceOperation.Status.SUCCEEDED,
    ).first()
    if barrier is not None:
        # Copy-back already completed under an earlier owner; only the commit is left.
        ownership.assert_held()
        return _commit(
            ownership=ownership,
            company_id=company_id,
            run_id=run_id,
            operation_id=barrier.pk,
            copied=None,
        )
    source, destination = workspace_dir(run), workspace_destination(run, issue)
    operation = _start_operation(
        ownership=ownership, run=run, issue=issue, source=source, destination=destination
    )
    report: CopybackReport | None = None
    try:
        ownership.assert_held()
        if source is not None:
            if destination is None:
                raise CopybackError(
                    "copyback_destination_missing",
                    "The run has a workspace directory but its execution workspace has no cwd.",
                )
            # Again here, right before the copy: the directory may have been replaced since the
            # result was accepted (by a link into another workspace, say), or the settings or
            # the workspaces changed.
            if (refusal := copyback_source_refusal(source)) is not None:
                raise CopybackError(
                    WorkspaceCopybackNotAllowed.code, f"{refusal}: {REFUSAL_TEXT[refusal]}"
                )
            with metrics.COPYBACK_DURATION.time():
                report = copyback_backend().copy_back(
                    run_id=run_id,
                    source=source,
                    destination=destination,
                    check=ownership.assert_held,
                )
            metrics.COPYBACK_BYTES.inc(report.bytes)
        ownership.assert_held()
    except FinalizationOwnershipLost:
        _finish_operation(
            operation=operation, succeeded=False, metadata={"error": "ownership_lost"}
        )
        raise
    except (CopybackError, OSError) as exc:
        code = exc.code if isinstance(exc, CopybackError) else "copyback_io_error"
        return _attempt_failed(
            ownership,
            operation=operation,
            code=code,
            exc=exc,
            final=code == WorkspaceCopybackNotAllowed.code,
        )
    _finish_operation(
        operation=operation,
        succeeded=True,
        metadata={
            "copied": None
            if report is None
            else {
                "files": report.files,
                "directories": report.directories,
                "bytes": report.bytes,
                "symlinks": report.symlinks,
                "skipped": list(report.skipped)[:100],
            },
        },
    )
    ownership.assert_held()
    return _commit(
        ownership=ownership,
        company_id=company_id,
        run_id=run_id,
        operation_id=operation.pk,
        copied=report,
    )


def _workspace_id(run: HeartbeatRun, issue: Issue) -> UUID | None:
    return run.execution_workspace_id or issue.execution_workspace_id


def _publish_owned(
    ownership: FinalizationOwnership,
    *,
    run: HeartbeatRun,
    issue: Issue,
    coordinator: NativeRunFinalization,
    tree: str,
) -> FinalizeOutcome:
    """Publish the run's snapshot as the workspace head in the commit
    (docs/snapshots.md#publishing): plan (fast-forward, merge, or the board's resolution merged
    against the head of now),
    then commit with the head moved by compare-and-set; a head moved meanwhile is planned
    again, a conflict is held for the board."""
    company_id, run_id = ownership.company_id, ownership.run_id
    mode = conflict_mode(company_id=company_id, run_id=run_id)
    if mode == "held":
        return _outcome(coordinator, run, "held", failure_code=HEAD_CONFLICT_CODE)
    workspace_id = _workspace_id(run, issue)
    snapshot = RunSnapshot.objects.filter(run_id=run_id, tree=tree).first()
    operation = _start_operation(
        ownership=ownership,
        run=run,
        issue=issue,
        source=None,
        destination=workspace_destination(run, issue),
        command="publish",
        observation="snapshot",
    )
    try:
        if workspace_id is None or snapshot is None:
            raise PublishError(
                "snapshot_binding_missing", "The run's snapshot or workspace is gone."
            )
        decision = mode if isinstance(mode, ConflictDecision) else None
        if decision is None or decision.resolution != "discard":
            try:
                workspace_cwd_adopt(company_id=company_id, workspace_id=workspace_id)
            except CwdUnadoptable as exc:
                raise PublishError(exc.code, str(exc)) from exc
        for _ in range(MAX_HEAD_RACES):
            ownership.assert_held()
            if decision is not None and decision.resolution != "discard":
                # The board's merge, against the head it decided on and then the head of now.
                plan = resolution_plan(
                    company_id=company_id,
                    workspace_id=workspace_id,
                    tree=tree,
                    base=snapshot.base,
                    resolution=decision.resolution,
                    decided_head=decision.decided_head,
                )
                plan = replace(plan, action_id=decision.action_id, decided_by=decision.decided_by)
            else:
                plan = publish_plan(
                    company_id=company_id,
                    workspace_id=workspace_id,
                    tree=tree,
                    base=snapshot.base,
                    resolution="merge" if decision is None else "discard",
                )
            ownership.assert_held()
            if plan.kind == "conflict":
                _finish_operation(
                    operation=operation,
                    succeeded=False,
                    metadata={"error": HEAD_CONFLICT_CODE, "publish": plan.as_json()},
                )
                return _hold_conflict(ownership, issue=issue, plan=plan)
            try:
                return _commit(
                    ownership=ownership,
                    company_id=company_id,
                    run_id=run_id,
                    operation_id=operation.pk,
                    copied=None,
                    publish=plan,
                    operation=operation,
                )
            except HeadMoved:
                continue  # another run published meanwhile: plan against its head
        raise PublishError("workspace_head_busy", "The head kept moving; retrying later.")
    except FinalizationOwnershipLost:
        _finish_operation(
            operation=operation, succeeded=False, metadata={"error": "ownership_lost"}
        )
        raise
    except (PublishError, DomainError, OSError) as exc:
        code = getattr(exc, "code", "publish_io_error")
        return _attempt_failed(ownership, operation=operation, code=code, exc=exc)


def _hold_conflict(
    ownership: FinalizationOwnership, *, issue: Issue, plan: PublishPlan
) -> FinalizeOutcome:
    """Hold the run for the board: nothing is published, no retry is spent."""
    with transaction.atomic(durable=True):
        _issue, coordinator, run = _locked_binding(
            company_id=ownership.company_id, run_id=ownership.run_id
        )
        _require_receipt(run, ownership)
        if coordinator is None:
            raise FinalizationNotReady(run_id=str(ownership.run_id))
        conflict_hold_in_tx(
            company_id=ownership.company_id,
            issue_id=issue.pk,
            run_id=run.pk,
            agent_id=run.agent_id,
            plan=plan,
        )
        coordinator.failure_code = HEAD_CONFLICT_CODE
        coordinator.failure_detail = {
            "code": HEAD_CONFLICT_CODE,
            "detail": f"{plan.conflict_count} conflicting path(s)",
            "conflictingPaths": list(plan.conflicts[:20]),
        }
        coordinator.next_attempt_at = None
        coordinator.updated_at = Now()
        coordinator.save(
            update_fields=["failure_code", "failure_detail", "next_attempt_at", "updated_at"]
        )
        return replace(
            _outcome(coordinator, run, "held", failure_code=HEAD_CONFLICT_CODE), published=plan
        )


def run_finalize(
    *, company_id: UUID, run_id: UUID, due_only: bool = False
) -> Acquired[FinalizeOutcome] | NotAcquired:
    """Finalize a run's workspace under finalization ownership: record `workspace_finalize`,
    copy the run's workspace directory back to the execution workspace's cwd, then commit.

    Returns NotAcquired(reason) when ownership isn't ours (see with_finalization_ownership).
    A copy-back failure keeps the saved result and schedules a retry (outcome
    retry_scheduled / retry_exhausted); a directory the copy-back guard refuses right before
    the copy (recovery.services.copyback_guard) is retry_exhausted at once, held for the board
    with failure code workspace_copyback_not_allowed. With `due_only` (the reconciler) a
    coordinator whose retry time is still ahead, rechecked under ownership, is left alone
    (outcome not_due).
    Locks: the finalization advisory lock (dedicated connection) for the whole run, then
    issue → coordinator → run per progress write. Raises FinalizationBindingMissing,
    FinalizationNotReady, FinalizationOwnershipLost (ownership lost mid-way: nothing is
    published after that).
    """

    def action(ownership: FinalizationOwnership) -> FinalizeOutcome:
        return _finalize_owned(ownership, due_only=due_only)

    outcome = with_finalization_ownership(company_id=company_id, run_id=run_id, action=action)
    if isinstance(outcome, NotAcquired):
        metrics.FINALIZATIONS_NOT_ACQUIRED.labels(outcome.reason).inc()
    return outcome


def finalizations_reconcile(
    *,
    batch_size: int = 50,
    progress: Callable[[UUID | None, str], None] | None = None,
) -> ReconcileSummary:
    """Defer a finalization job for every run whose coordinator waits for one (result_accepted /
    workspace_finalizing, no future retry time), in batches of `batch_size`.

    Skipped without deferring anything: a run whose finalization lock is held (a live owner is
    at work; it defers its own follow-up as it lets go), and a run held for the board whose
    prior owner has no worker platform to ask (only the board's confirmation, which defers its
    own job, can move it). A held run whose platform may still report the stop is deferred, so
    the stop proof is looked for again. Nothing counts against the retry budget here.
    `progress(run_id, text)` and `progress(None, batch_text)` report as it goes.
    """
    examined = deferred = already = busy = held = 0
    after: UUID | None = None
    batch_no = 0
    while True:
        batch = finalizations_waiting(after_run_id=after, limit=batch_size)
        if not batch:
            break
        batch_no += 1
        for company_id, run_id in batch:
            after = run_id
            examined += 1
            if advisory_lock_held(finalization_lock_key(company_id, run_id)):
                busy += 1
                text = "skipped (busy: an owner is finalizing it)"
            elif owner_hold_live(company_id=company_id, run_id=run_id) and not _platform_pending(
                run_id
            ):
                held += 1
                text = "skipped (held for the board)"
            else:
                with transaction.atomic():
                    job_id = finalization_defer_in_tx(company_id=company_id, run_id=run_id)
                if job_id is None:
                    already += 1
                    text = "already queued"
                else:
                    deferred += 1
                    text = f"deferred job {job_id}"
            if progress is not None:
                progress(run_id, text)
        if progress is not None:
            progress(None, f"batch {batch_no}: {len(batch)} run(s)")
    return ReconcileSummary(examined, deferred, already, busy, held)


def _platform_pending(run_id: UUID) -> bool:
    profile = HeartbeatRun.objects.filter(pk=run_id).values_list("runner_profile_json", flat=True)
    receipt = raw_owner(profile.first())
    return isinstance(receipt, dict) and receipt.get("worker") is not None
