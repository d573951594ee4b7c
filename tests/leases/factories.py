"""Factories and helpers for runtime-lease tests (the shared ones live in tests/factories.py)."""

from __future__ import annotations

from typing import Any
from uuid import UUID

from django.db import connection

from leases.services import RuntimeLeaseClaim, RuntimeLeaseOwner, runtime_lease_claim
from paperclip.models import Agent, ExecutionWorkspace


def claim(
    workspace: ExecutionWorkspace,
    agent: Agent,
    *,
    action: str = "start",
    issue_id: UUID | None = None,
    run_id: UUID | None = None,
    ttl_seconds: int | None = None,
) -> RuntimeLeaseClaim:
    """Claim through the real service as `agent` of the workspace's company."""
    return runtime_lease_claim(
        company_id=workspace.company_id,
        execution_workspace_id=workspace.pk,
        action=action,
        owner=RuntimeLeaseOwner.for_agent(agent.pk, run_id=run_id, issue_id=issue_id),
        ttl_seconds=ttl_seconds,
    )


def expire(workspace: ExecutionWorkspace, *, seconds_ago: int = 1) -> None:
    """Push the lease's expiry into the past on the database clock (no sleeping)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE execution_workspace_runtime_leases"
            " SET expires_at = now() - make_interval(secs => %s)"
            " WHERE execution_workspace_id = %s",
            [seconds_ago, workspace.pk],
        )


def lease_row(workspace: ExecutionWorkspace) -> dict[str, Any] | None:
    """The raw lease row (all columns) or None."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT * FROM execution_workspace_runtime_leases WHERE execution_workspace_id = %s",
            [workspace.pk],
        )
        row = cursor.fetchone()
        if row is None:
            return None
        return dict(zip([c.name for c in cursor.description], row, strict=True))


def running_run(
    *, status: str = "running", lease: bool = True, company: Any = None
) -> tuple[Any, RuntimeLeaseClaim | None]:
    """A native run of a new agent of `company` (default: a fresh one) on its issue and
    workspace (the issue's execution run when running), holding the workspace's runtime lease
    as `run:<id>` when `lease`: (run, claim)."""
    from paperclip.models import Issue
    from tests.paperclip.factories import (
        AgentFactory,
        CompanyFactory,
        ExecutionWorkspaceFactory,
        IssueFactory,
        NativeRunFactory,
    )

    company = company if company is not None else CompanyFactory()
    agent = AgentFactory(company=company)
    workspace = ExecutionWorkspaceFactory(company=company)
    issue = IssueFactory(company=company, assignee_agent=agent)
    run = NativeRunFactory(
        company=company,
        agent=agent,
        issue=issue,
        native_issue=issue,
        execution_workspace=workspace,
        status=status,
    )
    if status == "running":
        Issue.objects.filter(pk=issue.pk).update(execution_run=run, checkout_run=run)
    granted = claim(workspace, agent, run_id=run.pk) if lease else None
    return run, granted
