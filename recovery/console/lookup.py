"""The console's global id search: which objects of the operator's companies an id names."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True, slots=True)
class LookupHit:
    model: type[Model]
    pk: Any
    kind: str  # "run", "issue", ...
    label: str  # str(object)


def console_lookup(*, query: str, company_ids: Collection[Any] | None) -> list[LookupHit]:
    """Objects named by `query`: a uuid (run, issue, workspace, runtime or environment lease,
    recovery action, coordinator, agent, company), an owner key (`issue:<uuid>`,
    `run:<uuid>`, `agent:<uuid>`) or a provider allocation id. Only the companies in
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
            ("run", scoped(HeartbeatRun.objects.filter(pk=uid))),
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
    else:
        searches += [
            ("runtime lease", scoped(WorkspaceRuntimeLease.objects.filter(owner_key=text))),
            ("environment lease", scoped(EnvironmentLease.objects.filter(provider_lease_id=text))),
        ]
    hits: list[LookupHit] = []
    for kind, queryset in searches:
        for obj in queryset.order_by("pk")[:20]:
            hits.append(LookupHit(model=type(obj), pk=obj.pk, kind=kind, label=str(obj)))
    return hits
