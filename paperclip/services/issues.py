"""Writes of issues and execution workspaces.

Board-only; another company's objects answer NotFoundError (404), exactly like missing ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from uuid import UUID

from django.db import transaction
from django.db.models.functions import Now

from paperclip import selectors
from paperclip.access import Actor
from paperclip.activity import row_update_audited
from paperclip.db.locking import busy_on_lock_timeout, set_local_lock_timeout
from paperclip.errors import InvalidRequest, NotFoundError
from paperclip.locks import issues_for_update
from paperclip.models import Agent, ExecutionWorkspace, Issue
from paperclip.services.shared import (
    absolute_path_error,
    audit,
    require_board,
    workspace_cwd_check_in_tx,
)
from paperclip.snapshots.adopt import workspace_cwd_adopt_defer_in_tx


@dataclass(frozen=True, slots=True)
class IssueCreated:
    issue: Issue


def issue_create(
    *,
    actor: Actor,
    company_id: UUID | str,
    title: str,
    status: str = Issue.Status.BACKLOG,
    assignee_agent_id: UUID | None = None,
) -> IssueCreated:
    """Create an issue. The assignee must be an agent of the same company.

    Raises PermissionDenied (not a board actor), InvalidRequest (unknown status) or
    NotFoundError (company or assignee not visible / not in the company).
    """
    require_board(actor)
    if status not in Issue.Status.values:
        raise InvalidRequest(fields={"status": [f'"{status}" is not a valid choice.']})
    company = selectors.company_get(actor=actor, company_id=company_id)
    with transaction.atomic(durable=True):
        if (
            assignee_agent_id is not None
            and not Agent.objects.filter(pk=assignee_agent_id, company=company).exists()
        ):
            raise NotFoundError("The assignee agent was not found in this company.")
        issue = Issue.objects.create(
            company=company, title=title, status=status, assignee_agent_id=assignee_agent_id
        )
        audit(
            actor,
            company_id=company.pk,
            action="issue.created",
            entity_type="issue",
            entity_id=issue.pk,
            details={
                "title": title,
                "status": status,
                "assignee_agent_id": str(assignee_agent_id) if assignee_agent_id else None,
            },
        )
    return IssueCreated(issue=issue)


@dataclass(frozen=True, slots=True)
class IssueUpdate:
    issue: Issue
    changed: bool  # False when the request asked for the state the issue already had


def issue_update(
    *,
    actor: Actor,
    issue_id: UUID | str,
    status: str | None = None,
    hidden: bool | None = None,
) -> IssueUpdate:
    """Change an issue's status and/or hide it (hidden_at = database now()) or unhide it.

    Hiding an already hidden issue keeps its original hidden_at. Locks the issue row.
    Raises PermissionDenied, InvalidRequest (nothing to change / unknown status),
    NotFoundError, or ResourceBusy when the row stays locked for 5 s.
    """
    require_board(actor)
    if status is None and hidden is None:
        raise InvalidRequest(
            "Nothing to update.", fields={"non_field_errors": ["Give status and/or hidden."]}
        )
    if status is not None and status not in Issue.Status.values:
        raise InvalidRequest(fields={"status": [f'"{status}" is not a valid choice.']})
    visible = selectors.issue_get(actor=actor, issue_id=issue_id)
    with busy_on_lock_timeout(issue_id=str(visible.pk)), transaction.atomic(durable=True):
        set_local_lock_timeout()
        issue = issues_for_update().filter(pk=visible.pk).first()
        if issue is None:
            raise NotFoundError()
        changes: dict[str, Any] = {}
        values: dict[str, Any] = {}
        if status is not None and status != issue.status:
            changes["status"] = {"from": issue.status, "to": status}
            values["status"] = status
        if hidden is not None and hidden != (issue.hidden_at is not None):
            changes["hidden"] = {"from": not hidden, "to": hidden}
            values["hidden_at"] = Now() if hidden else None
        if values:
            row_update_audited(
                issue,
                {**values, "updated_at": Now()},
                company_id=issue.company_id,
                actor_type=actor.actor_type,
                actor_id=actor.actor_id,
                action="issue.updated",
                entity_type="issue",
                entity_id=issue.pk,
                details=changes,
            )
    return IssueUpdate(issue=issue, changed=bool(values))


@dataclass(frozen=True, slots=True)
class ExecutionWorkspaceCreated:
    workspace: ExecutionWorkspace


def execution_workspace_create(
    *, actor: Actor, company_id: UUID | str, name: str, cwd: str | None = None
) -> ExecutionWorkspaceCreated:
    """Create an execution workspace; `cwd`, if given, must be an absolute path, and the
    worker adopts what it holds as the workspace's first head (a job deferred here). Unless a
    superuser gives it, the `cwd` must not be, hold or lie inside another company's workspace
    `cwd`, the data directory or the blob store (`workspace_cwd_check_in_tx`).

    Locks: the advisory key `workspace_cwds_key()` when a `cwd` is given. Raises
    PermissionDenied, InvalidRequest (bad cwd), WorkspaceCwdNotAllowed or NotFoundError
    (company not visible).
    """
    require_board(actor)
    if cwd is not None and (problem := absolute_path_error(cwd)):
        raise InvalidRequest(fields={"cwd": [problem]})
    company = selectors.company_get(actor=actor, company_id=company_id)
    with transaction.atomic(durable=True):
        if cwd is not None:
            workspace_cwd_check_in_tx(cwd=cwd, company_id=company.pk, superuser=actor.is_superuser)
        workspace = ExecutionWorkspace.objects.create(company=company, name=name, cwd=cwd)
        audit(
            actor,
            company_id=company.pk,
            action="execution_workspace.created",
            entity_type="execution_workspace",
            entity_id=workspace.pk,
            details={"name": name, "cwd": cwd},
        )
        if cwd is not None:
            # Files already there become the head before the first run checks it out.
            workspace_cwd_adopt_defer_in_tx(company_id=company.pk, workspace_id=workspace.pk)
    return ExecutionWorkspaceCreated(workspace=workspace)
