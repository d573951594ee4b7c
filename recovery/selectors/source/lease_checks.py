"""One recorded lease, strictly: bound to the run and issue, retained (or a reusable export),
matching the descriptor, its allocation's history unambiguous, no writer active on the
workspace, and its environment present."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final
from uuid import UUID

from django.db.models import Q

from leases.environment.export_resume.sync_reference import NativeWorkspaceSyncReference
from leases.models import EnvironmentLease
from paperclip.ids import is_uuid
from paperclip.models import Environment, ExecutionWorkspace, HeartbeatRun
from recovery.errors import SourceFailure, binding_failure
from recovery.models import IssueRecoveryAction
from recovery.selectors.source.hand_off import (
    REUSABLE_POLICIES,
    ambiguous,
    check_predecessors,
    retired_reusable_lease_predecessors,
)
from recovery.selectors.source.remote_references import (
    RemoteWorkspaceAuthority,
    RemoteWorkspaceReference,
    as_dict,
)

RETAINED_POLICIES: Final = ("retain_on_failure", "ephemeral")
LEGACY_MIGRATION_SCHEMA: Final = "paperclip.legacy-workspace-source-migration.v1"


@dataclass(frozen=True, slots=True)
class RecoverySource:
    lease: EnvironmentLease
    environment: Environment
    reference: NativeWorkspaceSyncReference | None
    preservation_only: bool
    remote_reference: RemoteWorkspaceReference | None
    remote_workspace: ExecutionWorkspace | None
    remote_cwd: str


def has_migrated_legacy_workspace_source(
    *, company_id: UUID, run: HeartbeatRun, reference: NativeWorkspaceSyncReference
) -> bool:
    """True only when the run records that this exact legacy source was migrated (module
    docstring); the source is then returned for preservation only."""
    record = as_dict(run.result_json).get("legacyWorkspaceSourceMigration")
    return (
        isinstance(record, dict)
        and record.get("schema") == LEGACY_MIGRATION_SCHEMA
        and record.get("companyId") == str(company_id)
        and record.get("runId") == str(run.pk)
        and record.get("leaseId") == reference.lease_id
        and record.get("descriptorSha256") == reference.descriptor_sha256
    )


@dataclass(frozen=True, slots=True)
class References:
    """The workspace references the run recorded in its runner profile."""

    reference: NativeWorkspaceSyncReference | None  # a legacy native sync reference
    remote: RemoteWorkspaceReference | None  # a remote workspace reference
    remote_workspace: ExecutionWorkspace | None
    authority: RemoteWorkspaceAuthority | None

    @property
    def recovery_reference(self) -> NativeWorkspaceSyncReference | RemoteWorkspaceReference | None:
        return self.reference or self.remote


def inspect_lease(
    lease_key: str,
    *,
    company_id: UUID,
    issue_id: UUID,
    run: HeartbeatRun,
    refs: References,
    accepted_export: bool,
    now: Any,
) -> RecoverySource:
    """One recorded lease, strictly: bound to the run and issue, retained (or a reusable
    export), matching the descriptor, its allocation's history unambiguous, no writer active
    on the workspace, and its environment present (checked in that order)."""
    reference, remote = refs.reference, refs.remote
    legacy_descriptor = reference if reference and reference.lease_id == lease_key else None
    remote_descriptor = remote if remote and remote.lease_id == lease_key else None
    descriptor = legacy_descriptor or remote_descriptor
    lease, environment_id, allocation = _bound_lease(
        lease_key, company_id=company_id, issue_id=issue_id, run=run
    )
    remote_cwd = _retained_cwd(
        lease,
        descriptor=descriptor,
        remote_descriptor=remote_descriptor,
        authority=refs.authority,
        accepted_export=accepted_export,
    )
    _check_descriptor(
        lease,
        remote_cwd=remote_cwd,
        descriptor=descriptor,
        remote_descriptor=remote_descriptor,
        authority=refs.authority,
    )
    _check_hand_off(
        lease,
        allocation=allocation,
        company_id=company_id,
        issue_id=issue_id,
        run=run,
        descriptor=descriptor,
        remote_descriptor=remote_descriptor,
        remote_cwd=remote_cwd,
        now=now,
    )

    # Snapshot export writes only a new staging directory; a native baseline merge also
    # needs exclusive ownership of its host destination.
    if descriptor is not None and _writer_active(
        company_id=company_id,
        issue_key=str(issue_id),
        run=run,
        workspace_id=descriptor.workspace_id,
    ):
        raise SourceFailure("workspace_writer_active", "recheck_evidence")

    environment = Environment.objects.filter(pk=environment_id).first()
    if environment is None:
        raise SourceFailure("source_unavailable", "service_required")
    preservation_only = legacy_descriptor is not None and has_migrated_legacy_workspace_source(
        company_id=company_id, run=run, reference=legacy_descriptor
    )
    return RecoverySource(
        lease=lease,
        environment=environment,
        reference=legacy_descriptor,
        preservation_only=preservation_only,
        remote_reference=remote_descriptor,
        remote_workspace=refs.remote_workspace if remote_descriptor is not None else None,
        remote_cwd=remote_cwd,
    )


def _bound_lease(
    lease_key: str, *, company_id: UUID, issue_id: UUID, run: HeartbeatRun
) -> tuple[EnvironmentLease, UUID, str]:
    """The lease, bound to the run and the issue, with an environment, an allocation and a
    provider that is not local; with its environment id and allocation (provider lease id)."""
    invalid = binding_failure
    lease = EnvironmentLease.objects.filter(
        company_id=company_id, pk=UUID(lease_key), heartbeat_run_id=run.pk
    ).first()
    if lease is None:
        raise invalid("source_lease_not_bound")
    if lease.issue_id != issue_id:
        raise invalid("lease_issue_mismatch")
    if lease.environment_id is None:
        raise invalid("lease_environment_missing")
    if not lease.provider_lease_id:
        raise invalid("lease_allocation_missing")
    if not lease.provider or lease.provider == "local":
        raise invalid("lease_provider_invalid")
    return lease, lease.environment_id, lease.provider_lease_id


def _retained_cwd(
    lease: EnvironmentLease,
    *,
    descriptor: NativeWorkspaceSyncReference | RemoteWorkspaceReference | None,
    remote_descriptor: RemoteWorkspaceReference | None,
    authority: RemoteWorkspaceAuthority | None,
    accepted_export: bool,
) -> str:
    """The lease's absolute remote cwd, once its policy retains it (or it is a reusable
    allocation exporting a described source)."""
    invalid = binding_failure
    reusable_export = (
        descriptor is not None
        and (accepted_export or (remote_descriptor is not None and authority is not None))
        and lease.lease_policy in REUSABLE_POLICIES
    )
    if lease.lease_policy not in RETAINED_POLICIES and not reusable_export:
        raise invalid("lease_policy_not_retained", lease.lease_policy)
    remote_cwd = as_dict(lease.metadata).get("remoteCwd")
    if not isinstance(remote_cwd, str) or not remote_cwd.startswith("/"):
        raise invalid("lease_cwd_invalid")
    return remote_cwd


def _check_descriptor(
    lease: EnvironmentLease,
    *,
    remote_cwd: str,
    descriptor: NativeWorkspaceSyncReference | RemoteWorkspaceReference | None,
    remote_descriptor: RemoteWorkspaceReference | None,
    authority: RemoteWorkspaceAuthority | None,
) -> None:
    """The lease is the allocation, directory and workspace the run's descriptor names (and,
    for a remote one, in the environment its workspace's authority records)."""
    invalid = binding_failure
    if descriptor is not None and lease.provider_lease_id != descriptor.provider_lease_id:
        raise invalid("allocation_reference_mismatch")
    if descriptor is not None and remote_cwd != descriptor.remote_cwd:
        raise invalid("cwd_reference_mismatch")
    if (
        descriptor is not None
        and lease.execution_workspace_id is not None
        and str(lease.execution_workspace_id) != descriptor.workspace_id
    ):
        raise invalid("workspace_reference_mismatch")
    if remote_descriptor is not None:
        location = authority.location if authority is not None else None
        if location is None or str(lease.environment_id) != location.environment_id:
            raise invalid("workspace_reference_mismatch")


def _check_hand_off(
    lease: EnvironmentLease,
    *,
    allocation: str,
    company_id: UUID,
    issue_id: UUID,
    run: HeartbeatRun,
    descriptor: NativeWorkspaceSyncReference | RemoteWorkspaceReference | None,
    remote_descriptor: RemoteWorkspaceReference | None,
    remote_cwd: str,
    now: Any,
) -> None:
    """The allocation's other leases read as one clean hand-off to this one, by predecessors
    whose runs saved their work to this exact place; anything else is ambiguous ownership."""
    history = list(
        EnvironmentLease.objects.exclude(pk=lease.pk).filter(
            provider=lease.provider, provider_lease_id=lease.provider_lease_id
        )
    )
    predecessors = retired_reusable_lease_predecessors(lease, history)
    if predecessors is None:
        raise ambiguous()
    if not predecessors:
        return
    if (
        (run.runtime_mode != HeartbeatRun.RuntimeMode.NATIVE and remote_descriptor is None)
        or descriptor is None
        or as_dict(lease.metadata).get("agentId") != str(run.agent_id)
    ):
        raise ambiguous()
    check_predecessors(
        predecessors,
        company_id=company_id,
        issue_id=issue_id,
        run=run,
        descriptor=descriptor,
        remote_descriptor=remote_descriptor,
        provider_lease_id=allocation,
        remote_cwd=remote_cwd,
        now=now,
    )


def _writer_active(
    *, company_id: UUID, issue_key: str, run: HeartbeatRun, workspace_id: str
) -> bool:
    """A queued or running run targets the issue or the descriptor's workspace, other than the
    explicit fresh-isolated continuation an action of this issue recorded for this run."""
    continuations: set[UUID] = set()
    for evidence in IssueRecoveryAction.objects.filter(
        company_id=company_id, source_issue_id=UUID(issue_key), evidence__runId=str(run.pk)
    ).values_list("evidence", flat=True):
        continuation = as_dict(as_dict(evidence).get("explicitUserContinuation"))
        readiness = as_dict(continuation.get("readiness"))
        continuation_run = continuation.get("runId")
        # Exactly the run's id as text, not any spelling of it
        # (docs/recovery.md#issue-id-resolution).
        if (
            readiness.get("mode") == "fresh_isolated_workspace"
            and is_uuid(continuation_run)
            and str(UUID(continuation_run)) == continuation_run
        ):
            continuations.add(UUID(continuation_run))
    targets = (
        Q(native_issue_id=UUID(issue_key))
        | Q(issue_id=UUID(issue_key))
        | Q(context_snapshot__issueId=issue_key)
        | Q(context_snapshot__executionWorkspaceId=workspace_id)
    )
    if is_uuid(workspace_id):
        # Our runs also carry the workspace as a column: match that too.
        targets |= Q(execution_workspace_id=UUID(workspace_id))
    return (
        HeartbeatRun.objects.filter(company_id=company_id, status__in=HeartbeatRun.LIVE_STATUSES)
        .filter(targets)
        .exclude(pk__in=continuations)
        .exists()
    )
