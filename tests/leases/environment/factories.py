"""Factories and a baseline recovery scenario for environment-lease tests."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import factory

from leases.models import EnvironmentLease
from paperclip.models import (
    Agent,
    Company,
    Environment,
    ExecutionWorkspace,
    HeartbeatRun,
    Issue,
)
from recovery.models import IssueRecoveryAction
from tests.paperclip.factories import (
    AgentFactory,
    CompanyFactory,
    EnvironmentFactory,
    ExecutionWorkspaceFactory,
    NativeRunFactory,
)
from tests.recovery.factories import RecoveryActionFactory

PLUGIN = "plugin-daytona"
PROVIDER = "daytona"
HEX_A, HEX_B, HEX_C = "a" * 64, "b" * 64, "c" * 64


class ProviderAgentFactory(AgentFactory):
    """An agent with the provider role: the only kind that drives environment leases."""

    role = Agent.Role.PROVIDER


class EnvironmentLeaseFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = EnvironmentLease

    company = factory.SubFactory(CompanyFactory)
    environment = factory.SubFactory(EnvironmentFactory, company=factory.SelfAttribute("..company"))
    status = EnvironmentLease.Status.ACTIVE
    lease_policy = EnvironmentLease.Policy.EPHEMERAL
    provider = PROVIDER
    provider_lease_id = factory.Sequence(lambda n: f"sbx-{n}")
    metadata = factory.LazyFunction(lambda: {"pluginId": PLUGIN, "remoteCwd": "/workspace"})


def sync_reference(
    lease: EnvironmentLease, workspace_id: Any, *, state: str = "prepared", **changes: Any
) -> dict[str, Any]:
    reference = {
        "schema": "paperclip.native-workspace-sync/v1",
        "state": state,
        "descriptorSha256": HEX_A,
        "baselineSha256": HEX_B,
        "finalHostSha256": HEX_C if state == "finalized" else None,
        "workspaceId": str(workspace_id),
        "leaseId": str(lease.pk),
        "providerLeaseId": lease.provider_lease_id,
        "remoteCwd": "/workspace",
        "resourceDisposition": "destroy" if state == "finalized" else None,
    }
    reference.update(changes)
    return reference


def export_marker(lease: EnvironmentLease, **changes: Any) -> dict[str, Any]:
    marker = {
        "schema": "paperclip.workspace-export-resume.v2",
        "requestId": str(uuid.uuid4()),
        "purpose": "terminal_export",
        "companyId": str(lease.company_id),
        "runId": str(lease.heartbeat_run_id),
        "resultId": str(uuid.uuid4()),
        "leaseId": str(lease.pk),
        "provider": lease.provider,
        "providerLeaseId": lease.provider_lease_id,
        "pluginId": PLUGIN,
    }
    marker.update(changes)
    return marker


def pending_cleanup_lease(company: Company, *, intent: str | None = "export") -> EnvironmentLease:
    """A failed run's lease in pending_cleanup, with an export-resume marker (`export`), a
    stop-and-retain intent (`stop_and_retain`) or neither (None), both binding to it."""
    run = NativeRunFactory(company=company, status="failed")
    lease = EnvironmentLeaseFactory(
        company=company,
        heartbeat_run=run,
        issue=run.native_issue,
        status="pending_cleanup",
        cleanup_status="failed",
    )
    if intent == "export":
        set_meta(lease, nativeWorkspaceExportResume=export_marker(lease))
    elif intent == "stop_and_retain":
        set_meta(
            lease,
            sandboxStopAndRetain={
                "schema": "paperclip.sandbox-stop-and-retain.v1",
                "requestId": "req-1",
                "companyId": str(company.pk),
                "runId": str(run.pk),
                "leaseId": str(lease.pk),
                "provider": lease.provider,
                "providerLeaseId": lease.provider_lease_id,
                "pluginId": lease.metadata["pluginId"],
            },
        )
    return lease


def set_meta(lease: EnvironmentLease, **changes: Any) -> EnvironmentLease:
    lease.metadata = {**(lease.metadata or {}), **changes}
    lease.save(update_fields=["metadata"])
    return lease


def backing_off(company: Any) -> EnvironmentLease:
    """A failed cleanup after two attempts, its next retry an hour away."""
    lease = EnvironmentLeaseFactory(
        company=company, status="pending_cleanup", cleanup_status="failed"
    )
    return set_meta(
        lease,
        pendingCleanupInFlight=False,
        pendingCleanupRetryAttempts=2,
        pendingCleanupRetryAfterMs=int(time.time() * 1000) + 3_600_000,
    )


@dataclass
class Scenario:
    """A failed native run whose export lease is a valid recovery source (export cause).

    Fields are live model instances; mutate and `.save()` them to break one rule at a time.
    """

    company: Company
    issue: Issue
    agent: Agent
    workspace: ExecutionWorkspace
    environment: Environment
    run: HeartbeatRun
    lease: EnvironmentLease
    action: IssueRecoveryAction
    overrides: dict[str, Any] = field(default_factory=dict)

    @property
    def reference(self) -> dict[str, Any]:
        return self.run.runner_profile_json["nativeWorkspaceSync"]  # type: ignore[no-any-return, index]

    def set_reference(self, **changes: Any) -> None:
        self.run.runner_profile_json = {
            **(self.run.runner_profile_json or {}),
            "nativeWorkspaceSync": {**self.reference, **changes},
        }
        self.run.save(update_fields=["runner_profile_json"])

    def identity(self) -> dict[str, Any]:
        identity = {
            "company_id": self.company.pk,
            "issue_id": self.issue.pk,
            "run_id": self.run.pk,
            "action_id": self.action.pk,
        }
        identity.update(self.overrides)
        return identity


def build_scenario(*, company: Company | None = None) -> Scenario:
    company = company or CompanyFactory()
    run = NativeRunFactory(company=company, status=HeartbeatRun.Status.FAILED)
    issue, agent = run.native_issue, run.agent
    workspace = ExecutionWorkspaceFactory(company=company)
    environment = EnvironmentFactory(company=company)
    lease = EnvironmentLeaseFactory(
        company=company,
        environment=environment,
        issue=issue,
        heartbeat_run=run,
        execution_workspace=workspace,
        status=EnvironmentLease.Status.PENDING_CLEANUP,
        metadata={"pluginId": PLUGIN, "remoteCwd": "/workspace", "agentId": str(agent.pk)},
    )
    set_meta(lease, nativeWorkspaceExportResume=export_marker(lease))
    run.runner_profile_json = {"nativeWorkspaceSync": sync_reference(lease, workspace.pk)}
    run.save(update_fields=["runner_profile_json"])
    action = RecoveryActionFactory(
        workspace_source=True, source_issue=issue, evidence={"runId": str(run.pk)}
    )
    return Scenario(company, issue, agent, workspace, environment, run, lease, action)
