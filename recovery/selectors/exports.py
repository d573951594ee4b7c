"""What a run's workspace export reads (docs/recovery.md#workspace-export-repair): the tree its
accepted result names or the directory it copies back, the workspace `cwd` it writes, and the
environment lease (sandbox) the run held. Read-only; shared by finalization, which exports, and
the board's export repair, which checks that none of it changed since the hold."""

from __future__ import annotations

from typing import Any, Final
from uuid import UUID

from django.db.models import Q

from leases.environment.export_resume.termination import remote_termination_has
from leases.models import EnvironmentLease
from paperclip.models import (
    ExecutionWorkspace,
    HeartbeatRun,
    Issue,
    NativeRunFinalization,
    NativeRunResult,
)
from recovery.models import IssueRecoveryAction
from recovery.selectors.source.inspection import WORKSPACE_EXPORT_CAUSES

# A held export the finalizer opened carries its descriptor; an export-cause action recorded
# otherwise (a failed run's retained sandbox as its recovery source) is inspected, not retried.
HELD_EXPORT: Final = Q(cause__in=WORKSPACE_EXPORT_CAUSES, evidence__has_key="descriptor")
# Where a held export records the board's queued retry (`workspace_export_retry`).
EXPORT_RETRY_KEY: Final = "workspaceExportRetry"


def is_held_export(action: IssueRecoveryAction | None) -> bool:
    """The action is a held workspace export that Retry workspace export answers."""
    evidence = action.evidence if action is not None else None
    return (
        action is not None
        and action.cause in WORKSPACE_EXPORT_CAUSES
        and isinstance(evidence, dict)
        and "descriptor" in evidence
    )


def workspace_dir(run: HeartbeatRun) -> str | None:
    """The run's local workspace directory (the copy-back source), if its binding names one."""
    profile = run.runner_profile_json if isinstance(run.runner_profile_json, dict) else {}
    binding = (profile.get("nativeExecutionInput") or {}).get("binding") or {}
    value = binding.get("workspaceDir") if isinstance(binding, dict) else None
    return value if isinstance(value, str) and value else None


def execution_workspace_cwds() -> list[str]:
    """Every execution workspace's `cwd`, of every company (the copy-back never reads one:
    recovery.services.copyback_guard)."""
    cwds = ExecutionWorkspace.objects.exclude(cwd__isnull=True).exclude(cwd="")
    return [cwd for cwd in cwds.order_by().values_list("cwd", flat=True).distinct() if cwd]


def execution_workspace_has_head(workspace_id: UUID) -> bool:
    """Whether the workspace's files are kept as snapshots (it has a head)."""
    return ExecutionWorkspace.objects.filter(pk=workspace_id, head_tree__isnull=False).exists()


def workspace_destination(run: HeartbeatRun, issue: Issue) -> str | None:
    """The execution workspace's `cwd`, where the export writes."""
    workspace = run.execution_workspace or issue.execution_workspace
    return workspace.cwd if workspace is not None and workspace.cwd else None


def result_workspace_tree(result_id: UUID | None) -> str | None:
    """The tree an accepted result names (`workspace_tree`), if any."""
    if result_id is None:
        return None
    data = (
        NativeRunResult.objects.filter(pk=result_id).values_list("result_json", flat=True).first()
    )
    tree = data.get("workspaceTree") if isinstance(data, dict) else None
    return tree if isinstance(tree, str) else None


def export_descriptor(
    run: HeartbeatRun, issue: Issue, coordinator: NativeRunFinalization
) -> dict[str, Any]:
    """What the export of the saved result moves where: a snapshot tree published into the
    workspace, or a local directory copied back into it."""
    destination = workspace_destination(run, issue)
    tree = result_workspace_tree(coordinator.result_id)
    if tree is not None:
        return {"kind": "tree", "tree": tree, "destination": destination}
    return {"kind": "directory", "source": workspace_dir(run), "destination": destination}


def run_environment_lease(run: HeartbeatRun) -> EnvironmentLease | None:
    """The newest environment lease (sandbox) the run held, whatever its status."""
    return (
        EnvironmentLease.objects.filter(company_id=run.company_id, heartbeat_run_id=run.pk)
        .order_by("-acquired_at", "-id")
        .first()
    )


def lease_stop_confirmed(lease: EnvironmentLease) -> bool:
    """The run's sandbox is known to be stopped: a stop receipt bound to the lease for a remote
    provider, the lease retired for a `local` one (or none named)."""
    if lease.provider in (None, "", "local"):
        return lease.status in EnvironmentLease.RETIRED_STATUSES
    return remote_termination_has(lease)
