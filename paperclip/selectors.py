"""Reads of the core models, scoped to the calling actor.

Every `*_get` answers NotFoundError (404) both for a missing row and for a row of a company the
actor cannot see: another company's objects must be indistinguishable from absent ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from uuid import UUID

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

FINALIZATION_OWNER_KEY = "nativeWorkspaceFinalizationOwner"


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


@dataclass(frozen=True, slots=True)
class FinalizationOwner:
    """The durable finalization owner receipt of a run, as far as it is readable.

    Missing or malformed fields are None: a damaged receipt is still shown (it still blocks
    finalization upstream), never turned into an error.
    """

    token: str | None
    hostname: str | None
    pid: int | None
    process_started_at: str | None


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def run_finalization_owner(run: HeartbeatRun) -> FinalizationOwner | None:
    """The run's `runner_profile_json.nativeWorkspaceFinalizationOwner`, or None if absent."""
    profile = run.runner_profile_json
    if not isinstance(profile, dict):
        return None
    raw = profile.get(FINALIZATION_OWNER_KEY)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        return FinalizationOwner(token=None, hostname=None, pid=None, process_started_at=None)
    pid = raw.get("pid")
    return FinalizationOwner(
        token=_str_or_none(raw.get("token")),
        hostname=_str_or_none(raw.get("hostname")),
        # bool is an int subclass; a JSON true is not a pid.
        pid=pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
        process_started_at=_str_or_none(raw.get("processStartedAt")),
    )
