"""`result_accept`: the runner's result for a native run stored and its workspace
finalization queued."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from uuid import UUID, uuid4

from django.db import IntegrityError, transaction
from django.db.models.functions import Now

from paperclip.activity import activity_record
from paperclip.models import (
    HeartbeatRun,
    Issue,
    NativeRunFinalization,
    NativeRunResult,
    RunSnapshot,
)
from recovery.canonical import canonical_sha256
from recovery.errors import (
    FinalizationBindingMissing,
    NativeResultConflict,
    RunNotFinalizable,
    SnapshotNotRegistered,
    WorkspaceCopybackNotAllowed,
)
from recovery.selectors.exports import workspace_dir
from recovery.services.copyback_guard import copyback_source_refusal, copyback_workspace_refusal
from recovery.services.finalization.binding import (
    locked_binding,
    run_phase_mirror,
    run_workspace_id,
)
from recovery.services.finalization_jobs import finalization_defer_in_tx

TERMINAL_SCHEMA = "paperclip.prp.terminal.v1"


@dataclass(frozen=True, slots=True)
class ResultAcceptance:
    result: NativeRunResult
    created: bool  # False for an idempotent repeat


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
        issue, coordinator, run = locked_binding(company_id=company_id, run_id=run_id)
        _check_binding(run, agent_id=agent_id, workspace_tree=workspace_tree)
        existing = _existing_result(
            run_id=run_id, caller_result_id=caller_result_id, fingerprint=fingerprint
        )
        if (
            existing is not None
            and coordinator is not None
            and coordinator.result_id == existing.pk
        ):
            return ResultAcceptance(existing, created=False)
        _check_acceptable(
            run,
            coordinator,
            workspace_tree=workspace_tree,
            workspace_id=run_workspace_id(run, issue),
        )
        if run.completion_contract_id is None:
            # A result row needs a completion contract; runs created without one get theirs
            # minted here, under the run lock.
            run.completion_contract_id = uuid4()
        accepted = existing
        if accepted is None:
            accepted = _result_create(
                company_id=company_id,
                issue=issue,
                run=run,
                completion_contract_id=run.completion_contract_id,
                caller_result_id=caller_result_id,
                fingerprint=fingerprint,
                result_json=result_json,
                canonical=canonical,
            )
        if coordinator is None:
            coordinator = NativeRunFinalization(run_id=run_id, company_id=company_id)
        coordinator.issue_id = issue.pk
        coordinator.phase = NativeRunFinalization.Phase.RESULT_ACCEPTED
        coordinator.result_id = accepted.pk
        coordinator.next_attempt_at = None
        coordinator.updated_at = Now()
        coordinator.save()
        run_phase_mirror(
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


def _check_binding(run: HeartbeatRun, *, agent_id: UUID, workspace_tree: str | None) -> None:
    """The run is the agent's, and a named tree is a snapshot this run registered."""
    if run.agent_id != agent_id:
        raise FinalizationBindingMissing(run_id=str(run.pk))
    if (
        workspace_tree is not None
        and not RunSnapshot.objects.filter(run_id=run.pk, tree=workspace_tree).exists()
    ):
        raise SnapshotNotRegistered(workspace_tree=workspace_tree)


def _existing_result(
    *, run_id: UUID, caller_result_id: str | None, fingerprint: str
) -> NativeRunResult | None:
    """The result already stored under the caller's id (the same content, else a conflict)
    or with the same content."""
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
    return existing


def _check_acceptable(
    run: HeartbeatRun,
    coordinator: NativeRunFinalization | None,
    *,
    workspace_tree: str | None,
    workspace_id: UUID | None,
) -> None:
    """No other result was accepted, the run is still observed, and a directory to copy back
    passes the copy-back guard (and its workspace has no head to undo the copy)."""
    if coordinator is not None and coordinator.result_id is not None:
        raise NativeResultConflict(accepted_result_id=str(coordinator.result_id))
    if run.is_terminal or (coordinator is not None and coordinator.phase != "observed"):
        raise RunNotFinalizable(status=run.status)
    source = workspace_dir(run)
    if workspace_tree is None and source is not None:
        refusal = copyback_source_refusal(
            source, company_id=run.company_id
        ) or copyback_workspace_refusal(workspace_id)
        if refusal is not None:
            raise WorkspaceCopybackNotAllowed(reason=refusal)


def _result_create(
    *,
    company_id: UUID,
    issue: Issue,
    run: HeartbeatRun,
    completion_contract_id: UUID,
    caller_result_id: str | None,
    fingerprint: str,
    result_json: dict[str, Any],
    canonical: str,
) -> NativeRunResult:
    """The accepted result row; a concurrent insert of the same caller id is a conflict."""
    try:
        with transaction.atomic():
            return NativeRunResult.objects.create(
                company_id=company_id,
                issue_id=issue.pk,
                run_id=run.pk,
                completion_contract_id=completion_contract_id,
                caller_result_id=caller_result_id,
                server_fingerprint=fingerprint,
                schema_status=NativeRunResult.SchemaStatus.ACCEPTED,
                result_json=result_json,
                canonical_sha256=canonical,
            )
    except IntegrityError as exc:
        raise NativeResultConflict(caller_result_id=caller_result_id) from exc
