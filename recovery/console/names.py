"""Names for the ids in audit rows: the console shows "agent-3 (73bf1a2c)" rather than a bare
uuid. One query per entity type present (and one for the acting agents), whatever the number
of rows; reads only."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from uuid import UUID

from django.utils.safestring import SafeString

from leases.models import EnvironmentLease
from paperclip.admin.names import CORE_KINDS, NameKind, names_by_kind
from paperclip.admin.toolkit import named_link, short_id
from paperclip.ids import parse_uuid
from paperclip.models import (
    ActivityEvent,
    Agent,
    NativeRunFinalization,
    WorkspaceOperation,
)
from recovery.models import IssueRecoveryAction

# Audit rows' entity types whose id is the primary key of a console page, and how each is
# named (lease rows are named by their workspace, whose page links on to the lease).
ENTITY_KINDS: dict[str, NameKind] = {
    **CORE_KINDS,
    "native_run_finalization": NameKind(
        NativeRunFinalization, lambda o: f"coordinator ({o.phase})"
    ),
    "workspace_operation": NameKind(WorkspaceOperation, str),
    "environment_lease": NameKind(EnvironmentLease, lambda o: f"{o.provider} ({o.status})"),
    "issue_recovery_action": NameKind(IssueRecoveryAction, lambda o: o.cause.replace("_", " ")),
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
    entities = names_by_kind(wanted, ENTITY_KINDS)
    names = dict(Agent.objects.filter(pk__in=agents).values_list("pk", "name")) if agents else {}
    return AuditNames(entities=entities, agents=names)
