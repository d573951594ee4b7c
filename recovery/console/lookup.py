"""The console's global id search: which objects of the operator's companies an id names."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from django.db.models import Model, Q, QuerySet

from checkpoints.models import NativeRunnerCheckpoint
from leases.models import EnvironmentLease, WorkspaceRuntimeLease
from paperclip.ids import parse_uuid
from paperclip.models import (
    Agent,
    Company,
    ExecutionWorkspace,
    HeartbeatRun,
    Issue,
    NativeRunFinalization,
)
from recovery.models import IssueRecoveryAction

MAX_QUERY_CHARS = 200
# An id prefix shorter than this is taken as a name (four hex digits already narrow a table to
# one row in 65536).
MIN_PREFIX_HEX = 4
_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True, slots=True)
class LookupHit:
    model: type[Model]
    pk: Any
    kind: str  # "run", "issue", ...
    label: str  # str(object)


def id_prefix_range(text: str) -> tuple[UUID, UUID] | None:
    """The uuids that start with the hex digits `text` (dashes ignored, as in a short id
    `73bf1a2c`), as an inclusive range: PostgreSQL orders uuids by their bytes, so a prefix
    is a range of the primary key's index. None unless `text` is MIN_PREFIX_HEX to 31 hex
    digits."""
    digits = text.lower().replace("-", "")
    if not MIN_PREFIX_HEX <= len(digits) < 32 or not set(digits) <= _HEX:
        return None
    return UUID(digits.ljust(32, "0")), UUID(digits.ljust(32, "f"))


def console_lookup(*, query: str, company_ids: Collection[Any] | None) -> list[LookupHit]:
    """Objects named by `query`: a uuid (run, issue, workspace, runtime or environment lease,
    recovery action, coordinator, agent, company) or its first hex digits (a short id), an
    owner key (`issue:<uuid>`, `run:<uuid>`, `agent:<uuid>`), a provider allocation id, an
    agent's name or part of an issue's title or a workspace's name. Only the companies in
    `company_ids` (None: all); at most one query per kind; reads only."""
    text = query.strip()[:MAX_QUERY_CHARS]
    if not text or "\x00" in text:  # PostgreSQL text cannot hold NUL: nothing can match
        return []
    kind_hint, _, rest = text.partition(":")
    uid = parse_uuid(text) or (parse_uuid(rest) if kind_hint in {"issue", "run", "agent"} else None)

    def scoped(qs: QuerySet[Any], field: str = "company_id") -> QuerySet[Any]:
        return qs if company_ids is None else qs.filter(**{f"{field}__in": list(company_ids)})

    searches: list[tuple[str, QuerySet[Any]]] = []
    if uid is not None:
        searches += [
            ("run", scoped(HeartbeatRun.objects.filter(pk=uid).select_related("agent"))),
            ("issue", scoped(Issue.objects.filter(pk=uid))),
            ("execution workspace", scoped(ExecutionWorkspace.objects.filter(pk=uid))),
            (
                "runtime lease",
                scoped(
                    WorkspaceRuntimeLease.objects.filter(
                        Q(pk=uid) | Q(execution_workspace_id=uid) | Q(owner_key__endswith=str(uid))
                    )
                ),
            ),
            (
                "environment lease",
                scoped(EnvironmentLease.objects.filter(Q(pk=uid) | Q(heartbeat_run_id=uid))),
            ),
            (
                "recovery action",
                scoped(
                    IssueRecoveryAction.objects.filter(
                        Q(pk=uid) | Q(source_issue_id=uid) | Q(evidence__runId=str(uid))
                    )
                ),
            ),
            ("run coordinator", scoped(NativeRunFinalization.objects.filter(pk=uid))),
            ("agent", scoped(Agent.objects.filter(pk=uid))),
            ("company", scoped(Company.objects.filter(pk=uid), field="id")),
            (
                "checkpoint part",
                scoped(NativeRunnerCheckpoint.objects.filter(pk=uid).defer("nonce", "ciphertext")),
            ),
        ]
    elif (prefix := id_prefix_range(text)) is not None:
        searches += [
            ("run", scoped(HeartbeatRun.objects.filter(pk__range=prefix).select_related("agent"))),
            ("issue", scoped(Issue.objects.filter(pk__range=prefix))),
            ("execution workspace", scoped(ExecutionWorkspace.objects.filter(pk__range=prefix))),
            ("runtime lease", scoped(WorkspaceRuntimeLease.objects.filter(pk__range=prefix))),
            ("environment lease", scoped(EnvironmentLease.objects.filter(pk__range=prefix))),
            ("recovery action", scoped(IssueRecoveryAction.objects.filter(pk__range=prefix))),
            ("agent", scoped(Agent.objects.filter(pk__range=prefix))),
        ]
    if uid is None:
        # Names: a hex-looking word ("beef", "cafe01") may be a name as well as a prefix.
        searches += [
            ("runtime lease", scoped(WorkspaceRuntimeLease.objects.filter(owner_key=text))),
            ("environment lease", scoped(EnvironmentLease.objects.filter(provider_lease_id=text))),
            ("agent", scoped(Agent.objects.filter(name__icontains=text))),
            ("issue", scoped(Issue.objects.filter(title__icontains=text))),
            (
                "execution workspace",
                scoped(ExecutionWorkspace.objects.filter(name__icontains=text)),
            ),
        ]
    hits: list[LookupHit] = []
    seen: set[tuple[type[Model], Any]] = set()
    for kind, queryset in searches:
        for obj in queryset.order_by("pk")[:20]:
            if (type(obj), obj.pk) not in seen:  # an agent both named and prefixed "beef"
                seen.add((type(obj), obj.pk))
                hits.append(LookupHit(model=type(obj), pk=obj.pk, kind=kind, label=_label(obj)))
    return hits


def _label(obj: Model) -> str:
    if isinstance(obj, HeartbeatRun):
        return f"run {str(obj.pk)[:8]} of {obj.agent.name}"
    return str(obj)
