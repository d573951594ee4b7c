"""Reads of the core models, scoped to the calling actor.

Every `*_get` answers NotFoundError (404) both for a missing row and for a row of a company the
actor cannot see: another company's objects must be indistinguishable from absent ones.
"""

from __future__ import annotations

from uuid import UUID

from django.db.models.fields.json import KT

from paperclip.access import Actor, scoped_get
from paperclip.errors import NotFoundError
from paperclip.ids import parse_uuid
from paperclip.models import (
    Agent,
    AgentApiKey,
    Company,
    ExecutionWorkspace,
    HeartbeatRun,
    Issue,
)


def company_get(*, actor: Actor, company_id: UUID | str) -> Company:
    return scoped_get(Company.objects.all(), actor, company_id, company_field="id")


def agent_get(*, actor: Actor, agent_id: UUID | str) -> Agent:
    return scoped_get(Agent.objects.all(), actor, agent_id)


def agent_key_get(*, actor: Actor, key_id: UUID | str) -> AgentApiKey:
    """An agent key whose agent belongs to a company the actor can see."""
    pk = parse_uuid(key_id)
    key = (
        AgentApiKey.objects.select_related("agent").filter(pk=pk).first()
        if pk is not None
        else None
    )
    if key is None or not actor.can_access(key.agent.company_id):
        raise NotFoundError()
    return key


def issue_get(*, actor: Actor, issue_id: UUID | str) -> Issue:
    return scoped_get(Issue.objects.all(), actor, issue_id)


def execution_workspace_get(*, actor: Actor, workspace_id: UUID | str) -> ExecutionWorkspace:
    return scoped_get(ExecutionWorkspace.objects.all(), actor, workspace_id)


def run_get(*, actor: Actor, run_id: UUID | str) -> HeartbeatRun:
    return scoped_get(HeartbeatRun.objects.all(), actor, run_id)


def other_company_run_dirs(company_id: UUID) -> list[str]:
    """The distinct run directories (`workspaceDir`) named by the runs of every company but
    `company_id` (neither the copy-back nor a workspace `cwd` of this company may be one).

    All of them, not only those under a copy-back root by their text: a directory recorded
    through a symbolic link lies wherever the link points, so the guard compares them resolved.
    """
    key = "runner_profile_json__nativeExecutionInput__binding__workspaceDir"
    values = (
        HeartbeatRun.objects.exclude(company_id=company_id)
        .annotate(run_dir=KT(key))
        .filter(run_dir__startswith="/")
        .order_by()
        .values_list("run_dir", flat=True)
        .distinct()
    )
    return [value for value in values if value]
