"""Names for the ids in audit rows: the console shows "agent-3 (73bf1a2c)" rather than a bare
uuid. One query per entity type present (and one for the acting agents), whatever the number
of rows; reads only."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from django.db.models import Model
from django.utils.safestring import SafeString

from leases.models import EnvironmentLease
from paperclip.admin.toolkit import named_link, short_id
from paperclip.ids import parse_uuid
from paperclip.models import (
    ActivityEvent,
    Agent,
    Company,
    ExecutionWorkspace,
    HeartbeatRun,
    Issue,
    NativeRunFinalization,
    WorkspaceOperation,
)
from recovery.models import IssueRecoveryAction


@dataclass(frozen=True, slots=True)
class _Kind:
    model: type[Model]
    name: Callable[[Any], str]
    related: tuple[str, ...] = ()


def _run_name(run: HeartbeatRun) -> str:
    return f"run of {run.agent.name}"


# Audit rows' entity types whose id is the primary key of a console page, and how each is
# named (lease rows are named by their workspace, whose page links on to the lease).
ENTITY_KINDS: dict[str, _Kind] = {
    "company": _Kind(Company, lambda o: o.name),
    "agent": _Kind(Agent, lambda o: o.name),
    "issue": _Kind(Issue, lambda o: o.title),
    "heartbeat_run": _Kind(HeartbeatRun, _run_name, ("agent",)),
    "execution_workspace": _Kind(ExecutionWorkspace, lambda o: o.name),
    "native_run_finalization": _Kind(NativeRunFinalization, lambda o: f"coordinator ({o.phase})"),
    "workspace_operation": _Kind(WorkspaceOperation, str),
    "environment_lease": _Kind(EnvironmentLease, lambda o: f"{o.provider} ({o.status})"),
    "issue_recovery_action": _Kind(IssueRecoveryAction, lambda o: o.cause.replace("_", " ")),
}


@dataclass(frozen=True, slots=True)
class AuditNames:
    """The names of the entities and acting agents of some audit rows."""

    entities: dict[tuple[str, UUID], str]
    agents: dict[UUID, str]

    def entity_link(self, event: ActivityEvent) -> SafeString | str:
        """A link to the row's entity, labelled with its name and short id; the bare id when
        the entity has no page (or is gone)."""
        kind = ENTITY_KINDS.get(event.entity_type)
        uid = parse_uuid(event.entity_id)
        if kind is None or uid is None:
            return event.entity_id
        name = self.entities.get((event.entity_type, uid))
        if name is None:  # deleted since (a released lease, a purged run): still a page link
            name = f"{event.entity_type.replace('_', ' ')} {short_id(uid)}"
        return named_link(kind.model, uid, name, limit=32)

    def actor(self, event: ActivityEvent) -> SafeString | str:
        uid = parse_uuid(event.actor_id) if event.actor_type == "agent" else None
        if uid is None:
            return event.actor_id
        return named_link(Agent, uid, self.agents.get(uid, "agent"), limit=24)


def audit_names(events: Iterable[ActivityEvent]) -> AuditNames:
    """The names behind `events`' entity and actor ids (one query per entity type present)."""
    wanted: dict[str, set[UUID]] = defaultdict(set)
    agents: set[UUID] = set()
    for event in events:
        uid = parse_uuid(event.entity_id)
        if uid is not None and event.entity_type in ENTITY_KINDS:
            wanted[event.entity_type].add(uid)
        actor = parse_uuid(event.actor_id) if event.actor_type == "agent" else None
        if actor is not None:
            agents.add(actor)
    entities: dict[tuple[str, UUID], str] = {}
    for entity_type, ids in sorted(wanted.items()):
        kind = ENTITY_KINDS[entity_type]
        rows = kind.model._default_manager.filter(pk__in=ids)
        if kind.related:
            rows = rows.select_related(*kind.related)
        for obj in rows:
            entities[(entity_type, obj.pk)] = kind.name(obj)
    names = dict(Agent.objects.filter(pk__in=agents).values_list("pk", "name")) if agents else {}
    return AuditNames(entities=entities, agents=names)
