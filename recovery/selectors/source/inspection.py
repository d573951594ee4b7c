"""`recovery_source_inspect`: the recovery-source checks in their documented order
(docs/recovery.md#recovery-source-checks-in-order); the first failure wins."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final
from uuid import UUID

from django.db import connection, transaction

from leases.environment.export_resume.sync_reference import (
    NativeWorkspaceSyncReference,
    read_native_workspace_sync_reference,
)
from paperclip.db.clock import db_now
from paperclip.ids import is_uuid
from paperclip.models import (
    ExecutionWorkspace,
    ExecutionWorkspaceSnapshot,
    HeartbeatRun,
    NativeRunFinalization,
    NativeRunResult,
)
from recovery.errors import SourceFailure, SourceInspectionLimit, binding_failure
from recovery.models import IssueRecoveryAction
from recovery.selectors.source.execution import adapter_executing, controller_lease_live
from recovery.selectors.source.lease_checks import RecoverySource, References, inspect_lease
from recovery.selectors.source.remote_references import (
    RemoteWorkspaceAuthority,
    RemoteWorkspaceReference,
    as_dict,
    read_remote_workspace_authority,
    read_remote_workspace_reference,
    remote_reference_agrees,
)

WORKSPACE_EXPORT_CAUSES: Final = (
    "native_workspace_sync_out_unrecoverable",
    "native_workspace_sync_out_retry_exhausted",
)

RESTORE_RECOVERY_SCHEMA: Final = "paperclip.workspace-restore-recovery.v1"
HISTORICAL_SOURCE_SCHEMA: Final = "paperclip.historical-workspace-source.v1"

# How many sources the board API and the admin panel inspect at most per request.
MAXIMUM_SOURCES: Final = 50


@dataclass(frozen=True, slots=True)
class RecoverySourceInspection:
    run: HeartbeatRun
    action: IssueRecoveryAction
    sources: tuple[RecoverySource, ...]


def recovery_source_inspect(
    *,
    company_id: UUID,
    issue_id: UUID,
    run_id: UUID,
    action_id: UUID,
    maximum_sources: int | None = None,
) -> RecoverySourceInspection:
    """Resolve the workspace source recorded by the failed run `run_id` for recovery action
    `action_id` on issue `issue_id`; read-only.

    Runs in one REPEATABLE READ, READ ONLY transaction (or the caller's), so every check sees
    the same snapshot. Takes no locks. Raises SourceFailure (`source_binding_invalid` with a
    reason, `historical_source_missing`, `agent_stop_unconfirmed`,
    `allocation_ownership_ambiguous`, `workspace_writer_active`, `source_unavailable`) or
    SourceInspectionLimit when more than `maximum_sources` leases are recorded.
    """
    if connection.in_atomic_block:
        return _inspect(company_id, issue_id, run_id, action_id, maximum_sources)
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        return _inspect(company_id, issue_id, run_id, action_id, maximum_sources)


def _inspect(
    company_id: UUID,
    issue_id: UUID,
    run_id: UUID,
    action_id: UUID,
    maximum_sources: int | None,
) -> RecoverySourceInspection:
    """The checks, in the documented order (docs/recovery.md), one step each."""
    run, action, evidence = _bound_run_and_action(company_id, issue_id, run_id, action_id)
    refs = _workspace_references(company_id, run)  # 1. the run's own workspace references
    lease_ids = _recorded_lease_ids(  # 2. which leases the run recorded as its source
        run, action, evidence, refs.recovery_reference, maximum_sources
    )
    now = db_now()
    coordinator = _require_nobody_driving(company_id, run, now)  # 3. nobody drives the run
    accepted_export = _accepted_export(  # 4. a completed native result still owed copy-back
        company_id, issue_id, run, action, coordinator, refs.recovery_reference
    )
    sources = tuple(  # 5. every recorded lease, strictly
        inspect_lease(
            lease_key,
            company_id=company_id,
            issue_id=issue_id,
            run=run,
            refs=refs,
            accepted_export=accepted_export,
            now=now,
        )
        for lease_key in lease_ids
    )
    return RecoverySourceInspection(run=run, action=action, sources=sources)


def _bound_run_and_action(
    company_id: UUID, issue_id: UUID, run_id: UUID, action_id: UUID
) -> tuple[HeartbeatRun, IssueRecoveryAction, dict[str, Any]]:
    """The terminal run and the recovery action that names it, both bound to the issue."""
    invalid = binding_failure
    run = HeartbeatRun.objects.filter(company_id=company_id, pk=run_id).first()
    action = IssueRecoveryAction.objects.filter(
        company_id=company_id, source_issue_id=issue_id, pk=action_id
    ).first()
    if run is None:
        raise invalid("source_run_missing")
    if action is None:
        raise invalid("recovery_action_missing")
    evidence = as_dict(action.evidence)
    if evidence.get("runId") != str(run.pk):
        raise invalid("recovery_action_run_mismatch")
    if run.status not in HeartbeatRun.TERMINAL_STATUSES:
        raise invalid("source_run_not_terminal")
    bound_issue: object = run.native_issue_id or run.issue_id
    if bound_issue is None:
        bound_issue = as_dict(run.context_snapshot).get("issueId")
    if bound_issue is None or str(bound_issue) != str(issue_id):
        raise invalid("source_issue_mismatch")
    return run, action, evidence


def _workspace_references(company_id: UUID, run: HeartbeatRun) -> References:
    """At most one well-formed reference; a remote one must agree with its workspace's
    authority and, once saved, name a committed snapshot."""
    invalid = binding_failure
    profile = as_dict(run.runner_profile_json)
    raw_reference = profile.get("nativeWorkspaceSync")
    reference = read_native_workspace_sync_reference(raw_reference)
    if raw_reference is not None and reference is None:
        raise invalid("native_reference_invalid")
    raw_remote = profile.get("remoteWorkspace")
    remote = read_remote_workspace_reference(raw_remote)
    if (raw_remote is not None and remote is None) or (reference and remote):
        raise invalid("native_reference_invalid")
    remote_workspace: ExecutionWorkspace | None = None
    authority: RemoteWorkspaceAuthority | None = None
    if remote is not None:
        remote_workspace = ExecutionWorkspace.objects.filter(
            company_id=company_id, pk=UUID(remote.workspace_id)
        ).first()
        authority = read_remote_workspace_authority(
            remote_workspace.metadata if remote_workspace is not None else None
        )
        if remote_workspace is None or not remote_reference_agrees(remote, authority, run.pk):
            raise invalid("workspace_reference_mismatch")
        if remote.state == "saved":
            committed = remote.snapshot_id is not None and (
                ExecutionWorkspaceSnapshot.objects.filter(
                    company_id=company_id,
                    execution_workspace_id=remote_workspace.pk,
                    pk=UUID(remote.snapshot_id),
                    status="committed",
                ).exists()
            )
            if not committed:
                raise invalid("workspace_reference_mismatch")
    return References(reference, remote, remote_workspace, authority)


def _recorded_lease_ids(
    run: HeartbeatRun,
    action: IssueRecoveryAction,
    evidence: dict[str, Any],
    recovery_reference: NativeWorkspaceSyncReference | RemoteWorkspaceReference | None,
    maximum_sources: int | None,
) -> list[str]:
    """The lease ids the run recorded: its restore record, else an export's own reference,
    else the action's historical source; distinct UUIDs that include the reference's."""
    invalid = binding_failure
    recorded = as_dict(run.result_json).get("workspaceRestoreRecovery")
    if recorded is not None and as_dict(recorded).get("schema") != RESTORE_RECOVERY_SCHEMA:
        raise invalid("restore_reference_invalid")
    historical = evidence.get("historicalWorkspaceSource")
    if historical is not None and (
        as_dict(historical).get("schema") != HISTORICAL_SOURCE_SCHEMA
        or as_dict(historical).get("runId") != str(run.pk)
    ):
        raise invalid("historical_reference_invalid")
    lease_ids: object
    if recorded is not None:
        lease_ids = as_dict(recorded).get("leaseIds")
    elif recovery_reference is not None and action.cause in WORKSPACE_EXPORT_CAUSES:
        lease_ids = [recovery_reference.lease_id]
    else:
        lease_ids = as_dict(historical).get("leaseIds")
    if not isinstance(lease_ids, list) or not lease_ids:
        raise SourceFailure("historical_source_missing", "use_alternative_strategy")
    if maximum_sources is not None and len(lease_ids) > maximum_sources:
        raise SourceInspectionLimit(maximum_sources=maximum_sources, recorded=len(lease_ids))
    if (
        any(not is_uuid(item) for item in lease_ids)
        or len(set(lease_ids)) != len(lease_ids)
        or (recovery_reference is not None and recovery_reference.lease_id not in lease_ids)
    ):
        raise invalid("lease_reference_invalid")
    return lease_ids


def _require_nobody_driving(
    company_id: UUID, run: HeartbeatRun, now: Any
) -> NativeRunFinalization | None:
    """No executing adapter and no live controller lease (the coordinator's own lease, which
    the controller-lease service keeps and a terminal run ends): the run's coordinator, if
    any."""
    coordinator = NativeRunFinalization.objects.filter(company_id=company_id, run_id=run.pk).first()
    if controller_lease_live(coordinator, now) or adapter_executing(run.pk):
        raise SourceFailure("agent_stop_unconfirmed", "recheck_evidence")
    return coordinator


def _accepted_export(
    company_id: UUID,
    issue_id: UUID,
    run: HeartbeatRun,
    action: IssueRecoveryAction,
    coordinator: NativeRunFinalization | None,
    recovery_reference: NativeWorkspaceSyncReference | RemoteWorkspaceReference | None,
) -> bool:
    """Reusable allocations can still owe copy-back for a completed native result. This
    authorizes preservation of the exact descriptor only, never reuse for agent execution."""
    return bool(
        recovery_reference is not None
        and action.cause in WORKSPACE_EXPORT_CAUSES
        and run.runtime_mode == HeartbeatRun.RuntimeMode.NATIVE
        and coordinator is not None
        and coordinator.issue_id == issue_id
        and coordinator.result_id is not None
        and run.completion_contract_id is not None
        and NativeRunResult.objects.filter(
            company_id=company_id,
            issue_id=issue_id,
            run_id=run.pk,
            pk=coordinator.result_id,
            completion_contract_id=run.completion_contract_id,
            schema_status=NativeRunResult.SchemaStatus.ACCEPTED,
            result_json__terminal__runTerminalState="succeeded",
        ).exists()
    )
