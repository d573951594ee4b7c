"""Everything that hangs off one run, for its console page: coordinator, runtime and
environment leases, recovery actions, checkpoint parts (names, sizes, times; never contents),
workspace operations and audit rows. A fixed number of queries; reads only."""

from __future__ import annotations

from dataclasses import dataclass

from django.db.models import Q
from django.utils.safestring import SafeString

from checkpoints.models import NativeRunnerCheckpoint
from leases.admin import lease_owner_link
from leases.models import EnvironmentLease, WorkspaceRuntimeLease
from leases.renewal import RenewalCadence
from leases.selectors import lease_renewal, with_renewal_age, with_stale_reason
from paperclip.models import ActivityEvent, HeartbeatRun, NativeRunFinalization, WorkspaceOperation
from recovery.models import IssueRecoveryAction

RELATED_LIMIT = 50
# What a runtime lease row's owner and workspace are named by, joined in its one query.
_LEASE_NAMES = ("execution_workspace", "owner_issue", "owner_run__agent", "owner_agent")


@dataclass(frozen=True, slots=True)
class RuntimeLeaseRow:
    lease: WorkspaceRuntimeLease
    owner: SafeString | str  # its name beside its short id, linked
    renewal: RenewalCadence


@dataclass(frozen=True, slots=True)
class RunRelated:
    coordinator: NativeRunFinalization | None
    runtime_leases: list[RuntimeLeaseRow]
    environment_leases: list[EnvironmentLease]
    recovery_actions: list[IssueRecoveryAction]
    checkpoint_parts: list[NativeRunnerCheckpoint]
    operations: list[WorkspaceOperation]
    activity: list[ActivityEvent]


def run_related(run: HeartbeatRun) -> RunRelated:
    company = run.company_id
    lease_match = Q(owner_run_id=run.pk) | Q(owner_key=f"run:{run.pk}")
    if run.execution_workspace_id is not None:
        lease_match |= Q(execution_workspace_id=run.execution_workspace_id)
    return RunRelated(
        coordinator=NativeRunFinalization.objects.filter(run_id=run.pk, company_id=company).first(),
        runtime_leases=[
            RuntimeLeaseRow(lease, lease_owner_link(lease), lease_renewal(lease))
            for lease in with_renewal_age(
                with_stale_reason(
                    WorkspaceRuntimeLease.objects.filter(lease_match, company_id=company)
                )
            ).select_related(
                "execution_workspace", "owner_issue", "owner_run__agent", "owner_agent"
            )[:RELATED_LIMIT]
        ],
        environment_leases=list(
            EnvironmentLease.objects.filter(heartbeat_run_id=run.pk, company_id=company).order_by(
                "-acquired_at"
            )[:RELATED_LIMIT]
        ),
        recovery_actions=list(
            IssueRecoveryAction.objects.filter(
                company_id=company, evidence__runId=str(run.pk)
            ).order_by("-created_at")[:RELATED_LIMIT]
        ),
        checkpoint_parts=list(
            NativeRunnerCheckpoint.objects.filter(run_id=run.pk, company_id=company)
            .only("id", "part", "size_bytes", "created_at", "updated_at")
            .order_by("part")[:RELATED_LIMIT]
        ),
        operations=list(
            WorkspaceOperation.objects.filter(heartbeat_run_id=run.pk, company_id=company).order_by(
                "-started_at"
            )[:RELATED_LIMIT]
        ),
        activity=list(
            ActivityEvent.objects.filter(
                Q(run_id=run.pk) | Q(entity_id=str(run.pk)), company_id=company
            ).order_by("-created_at")[:RELATED_LIMIT]
        ),
    )
