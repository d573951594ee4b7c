"""The durable `workspace_finalize` operation of an attempt (started, finished), and the
retry schedule of a failed attempt."""

from __future__ import annotations

from datetime import timedelta
from typing import Any
from uuid import UUID

from django.db import transaction
from django.db.models.functions import Now

from paperclip.activity import activity_record
from paperclip.db.locking import require_transaction
from paperclip.models import (
    HeartbeatRun,
    Issue,
    NativeRunFinalization,
    NativeRunResult,
    WorkspaceOperation,
)
from recovery.errors import FinalizationNotReady
from recovery.selectors.actions import WAITING_PHASES
from recovery.services.export_repair import export_hold_in_tx
from recovery.services.finalization.binding import (
    FINALIZER,
    locked_binding,
    max_attempts,
    require_receipt,
    run_phase_mirror,
)
from recovery.services.finalization.outcomes import FinalizeOutcome, outcome_of
from recovery.services.ownership.lock_connection import FinalizationOwnership

RETRY_BASE_SECONDS = 30

RETRY_CAP_SECONDS = 900


def terminal_state(result: NativeRunResult | None) -> str:
    data = result.result_json if result is not None else None
    terminal = data.get("terminal") if isinstance(data, dict) else None
    state = terminal.get("runTerminalState") if isinstance(terminal, dict) else None
    return state if state in HeartbeatRun.TERMINAL_STATUSES else "succeeded"


def start_operation(
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
        issue, coordinator, locked = locked_binding(company_id=run.company_id, run_id=run.pk)
        require_receipt(locked, ownership)
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
        run_phase_mirror(locked, NativeRunFinalization.Phase.WORKSPACE_FINALIZING, touch=False)
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


def finish_operation(
    *, operation: WorkspaceOperation, succeeded: bool, metadata: dict[str, Any]
) -> None:
    with transaction.atomic(durable=True):
        finish_operation_in_tx(operation=operation, succeeded=succeeded, metadata=metadata)


def finish_operation_in_tx(
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


def schedule_retry(
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
        _issue, coordinator, run = locked_binding(company_id=company_id, run_id=run_id)
        if coordinator is None:
            raise FinalizationNotReady(run_id=str(run_id))
        require_receipt(run, ownership)
        if coordinator.phase == NativeRunFinalization.Phase.COMMITTED:
            # A committed coordinator is never overwritten by a late failure.
            return outcome_of(coordinator, run, "already_committed")
        exhausted = final or coordinator.attempt >= max_attempts()
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
        return outcome_of(
            coordinator,
            run,
            "retry_exhausted" if exhausted else "retry_scheduled",
            failure_code=coordinator.failure_code,
        )


def attempt_failed(
    ownership: FinalizationOwnership,
    *,
    operation: WorkspaceOperation,
    code: str,
    exc: Exception,
    final: bool = False,
) -> FinalizeOutcome:
    """A copy-back or publish attempt failed: close its operation with the error and keep the
    saved result for a retry (the same for both ways a run's work reaches its workspace);
    `final`: no retry, the board's hold at once (see schedule_retry)."""
    finish_operation(
        operation=operation, succeeded=False, metadata={"error": code, "detail": str(exc)}
    )
    return schedule_retry(
        ownership=ownership,
        company_id=ownership.company_id,
        run_id=ownership.run_id,
        code=code,
        detail=str(exc),
        final=final,
    )
