"""Reads of runtime leases: the lease value type, the live stale-owner verdict, lookups.

The stale verdict is one SQL expression (`stale_reason_expression`) shared by the claim path,
`runtime_lease_get`, the admin changelist and the sweep, so "stale" means the same thing
everywhere and a whole page of leases is judged in one query. Database time (`now()`) is the
only clock.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, Literal, cast
from uuid import UUID

from django.db.models import (
    BooleanField,
    Case,
    DurationField,
    ExpressionWrapper,
    F,
    Func,
    OuterRef,
    QuerySet,
    Subquery,
    TextField,
    UUIDField,
    Value,
    When,
)
from django.db.models.functions import Cast, Coalesce, Now, NullIf, Substr
from django.utils import timezone

from leases.models import WorkspaceRuntimeLease
from leases.renewal import RenewalCadence, renewal_cadence
from paperclip.db.sql import iso_json_sql, json_object_sql
from paperclip.models import HeartbeatRun, Issue

StaleReason = Literal[
    "lease_expired",
    "owner_issue_missing",
    "owner_issue_hidden",
    "owner_issue_terminal",
    "owner_run_missing",
    "owner_run_terminal",
]
STALE_REASONS: Final[tuple[StaleReason, ...]] = (
    "lease_expired",
    "owner_issue_missing",
    "owner_issue_hidden",
    "owner_issue_terminal",
    "owner_run_missing",
    "owner_run_terminal",
)

# Issue statuses that keep an issue-owned lease alive (docs/leases.md#stale-reasons).
ELIGIBLE_ISSUE_STATUSES: Final[tuple[str, ...]] = (
    Issue.Status.BACKLOG,
    Issue.Status.TODO,
    Issue.Status.IN_PROGRESS,
    Issue.Status.IN_REVIEW,
    Issue.Status.BLOCKED,
)
TERMINAL_RUN_STATUSES: Final[tuple[str, ...]] = tuple(sorted(HeartbeatRun.TERMINAL_STATUSES))

LEASE_TABLE: Final = WorkspaceRuntimeLease._meta.db_table
# Column list shared by every raw statement that returns a lease (order = RuntimeLease fields).
LEASE_COLUMNS: Final = (
    "id, company_id, execution_workspace_id, owner_key, owner_issue_id, owner_run_id, "
    "owner_agent_id, last_action, generation, claimed_at, renewed_at, expires_at, metadata, fence"
)

_UUID_RE: Final = r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"


@dataclass(frozen=True, slots=True)
class RuntimeLease:
    """A runtime lease as services and the API see it (no ORM instance on the hot path)."""

    id: UUID
    company_id: UUID
    execution_workspace_id: UUID
    owner_key: str
    owner_issue_id: UUID | None
    owner_run_id: UUID | None
    owner_agent_id: UUID | None
    last_action: str
    generation: int
    claimed_at: datetime
    renewed_at: datetime
    expires_at: datetime
    metadata: dict[str, Any] | None
    # Strictly increasing over every grant of the workspace, also across a failover that lost
    # the last grants (docs/leases.md#fence).
    fence: int = 0

    @classmethod
    def from_row(cls, row: tuple[Any, ...]) -> RuntimeLease:
        """Build from a row selected with LEASE_COLUMNS."""
        metadata = row[12]
        # Django's psycopg backend hands jsonb to raw cursors as text.
        if isinstance(metadata, str):
            metadata = json.loads(metadata)
        return cls(
            id=row[0],
            company_id=row[1],
            execution_workspace_id=row[2],
            owner_key=row[3],
            owner_issue_id=row[4],
            owner_run_id=row[5],
            owner_agent_id=row[6],
            last_action=row[7],
            generation=row[8],
            claimed_at=row[9],
            renewed_at=row[10],
            expires_at=row[11],
            metadata=metadata,
            fence=row[13],
        )

    @classmethod
    def from_model(cls, lease: WorkspaceRuntimeLease) -> RuntimeLease:
        return cls(
            id=lease.id,
            company_id=lease.company_id,
            execution_workspace_id=lease.execution_workspace_id,
            owner_key=lease.owner_key,
            owner_issue_id=lease.owner_issue_id,
            owner_run_id=lease.owner_run_id,
            owner_agent_id=lease.owner_agent_id,
            last_action=lease.last_action,
            generation=lease.generation,
            claimed_at=lease.claimed_at,
            renewed_at=lease.renewed_at,
            expires_at=lease.expires_at,
            metadata=lease.metadata,
            fence=lease.fence,
        )


@dataclass(frozen=True, slots=True)
class RuntimeLeaseView:
    """A lease (or none) with its live stale verdict."""

    lease: RuntimeLease | None
    stale_reason: StaleReason | None


def _owner_ref(kind: str) -> Case:
    """The uuid named by an `<kind>:<uuid>` owner key, else NULL.

    Staleness is judged from the owner key, not the FK columns: those are nulled when the
    issue or run is deleted, and that is exactly the `..._missing` case. The regex guard keeps
    a malformed key from failing the uuid cast (it then reads as a missing owner).
    """
    return Case(
        When(
            owner_key__regex=rf"^{kind}:{_UUID_RE}$",
            then=Cast(Substr("owner_key", len(kind) + 2), UUIDField()),
        ),
        default=Value(None, output_field=UUIDField()),
    )


def _issue_verdict() -> Subquery:
    healthy = Value("")
    verdict = (
        Issue.objects.filter(pk=OuterRef("_owner_issue_ref"), company_id=OuterRef("company_id"))
        .annotate(
            verdict=Case(
                When(hidden_at__isnull=False, then=Value("owner_issue_hidden")),
                When(status__in=ELIGIBLE_ISSUE_STATUSES, then=healthy),
                default=Value("owner_issue_terminal"),
                output_field=TextField(),
            )
        )
        .values("verdict")[:1]
    )
    return Subquery(verdict, output_field=TextField())


def _run_verdict() -> Subquery:
    verdict = (
        HeartbeatRun.objects.filter(
            pk=OuterRef("_owner_run_ref"), company_id=OuterRef("company_id")
        )
        .annotate(
            verdict=Case(
                When(status__in=TERMINAL_RUN_STATUSES, then=Value("owner_run_terminal")),
                default=Value(""),
                output_field=TextField(),
            )
        )
        .values("verdict")[:1]
    )
    return Subquery(verdict, output_field=TextField())


# The lease's JSON as PostgreSQL renders it from the row, for answers with many leases (the
# batch renew): the keys and values of the API's LeaseSerializer, in its order
# (tests/leases/api/test_lease_rendering.py holds the two equal and fails on a key added to
# one only). `{t}` is the table's alias in the statement.
LEASE_JSON_KEYS: Final = (
    ("id", "{t}.id"),
    ("company_id", "{t}.company_id"),
    ("execution_workspace_id", "{t}.execution_workspace_id"),
    ("owner_key", "{t}.owner_key"),
    ("owner_issue_id", "{t}.owner_issue_id"),
    ("owner_run_id", "{t}.owner_run_id"),
    ("owner_agent_id", "{t}.owner_agent_id"),
    ("last_action", "{t}.last_action"),
    ("generation", "{t}.generation"),
    ("fence", "{t}.fence"),
    ("claimed_at", iso_json_sql("{t}.claimed_at")),
    ("renewed_at", iso_json_sql("{t}.renewed_at")),
    ("expires_at", iso_json_sql("{t}.expires_at")),
    ("metadata", "{t}.metadata"),
)


def lease_json_sql(alias: str) -> str:
    """SQL text for the JSON (text) of the lease row `alias` (LEASE_JSON_KEYS)."""
    return json_object_sql([(key, sql.format(t=alias)) for key, sql in LEASE_JSON_KEYS])


def _sql_literals(values: tuple[str, ...]) -> str:
    """`'a', 'b'`: status values as SQL literals (plain snake_case words, checked)."""
    if not all(re.fullmatch(r"[a-z_]+", value) for value in values):
        raise ValueError(f"not a plain status value: {values!r}")
    return ", ".join(f"'{value}'" for value in values)


def owner_stale_reason_sql(
    *, company: str, issue: str | None, run: str | None, run_agent: str | None = None
) -> str:
    """SQL text for the stale reason a lease held by a claimant's owner would have right now,
    leaving expiry aside; NULL when that owner is live (docs/leases.md#owner-eligibility).

    `company`, `issue` and `run` are SQL expressions of type uuid (placeholders with a cast).
    The owner is the one the owner key names (`RuntimeLeaseOwner.owner_key`): the issue if
    named, else the run, else only the agent (never stale). With both `issue` and `run` the
    text picks at run time (either value may be NULL); a statement built for one shape of
    claimant passes only what it judges (`issue` alone: the issue must be named; `run` alone:
    the run is named and no issue), so the hot path carries no dead branch. `run_agent`
    restricts the run lookup to that agent's runs (another agent's run then reads as missing):
    only for a statement where any miss means "take the slow path and find out why".

    The verdict is `stale_reason_expression`'s owner part, built from the same
    ELIGIBLE_ISSUE_STATUSES / TERMINAL_RUN_STATUSES and checked in the same order, so a
    claimant is refused exactly when the lease it would hold would be reclaimable at once.
    Raw SQL because it runs inside the claim's raw statements (the renew fast path among
    them); a test pins it to the ORM verdict for every status.
    """
    # '' is "live" inside, so that COALESCE can tell a live owner from a missing row.
    issue_verdict = (
        "COALESCE((SELECT CASE WHEN i.hidden_at IS NOT NULL THEN 'owner_issue_hidden'"  # noqa: S608
        f" WHEN i.status IN ({_sql_literals(ELIGIBLE_ISSUE_STATUSES)}) THEN ''"
        " ELSE 'owner_issue_terminal' END"
        f" FROM issues i WHERE i.id = {issue} AND i.company_id = {company}),"
        " 'owner_issue_missing')"
    )
    run_verdict = (
        "COALESCE((SELECT CASE"  # noqa: S608
        f" WHEN r.status IN ({_sql_literals(TERMINAL_RUN_STATUSES)}) THEN 'owner_run_terminal'"
        " ELSE '' END"
        f" FROM heartbeat_runs r WHERE r.id = {run} AND r.company_id = {company}"
        f"{'' if run_agent is None else f' AND r.agent_id = {run_agent}'}),"
        " 'owner_run_missing')"
    )
    if issue is not None and run is not None:
        verdict = (
            f"CASE WHEN {issue} IS NOT NULL THEN {issue_verdict}"
            f" WHEN {run} IS NOT NULL THEN {run_verdict} END"
        )
    elif issue is not None:
        verdict = issue_verdict
    elif run is not None:
        verdict = run_verdict
    else:
        return "NULL::text"
    return f"NULLIF({verdict}, '')"


def stale_reason_expression() -> Case:
    """SQL for the live stale reason of a lease row (NULL = its owner is still live).

    Needs the `_owner_issue_ref` / `_owner_run_ref` aliases that `with_stale_reason` adds.
    Order matters (docs/leases.md#stale-reasons): expiry first, then the owner's lifecycle;
    agent-only (and unparseable) owners recover only by TTL.
    """
    return Case(
        When(expires_at__lte=Now(), then=Value("lease_expired")),
        When(
            owner_key__startswith="issue:",
            then=NullIf(Coalesce(_issue_verdict(), Value("owner_issue_missing")), Value("")),
        ),
        When(
            owner_key__startswith="run:",
            then=NullIf(Coalesce(_run_verdict(), Value("owner_run_missing")), Value("")),
        ),
        default=Value(None, output_field=TextField()),
        output_field=TextField(),
    )


# django-stubs cannot see annotations added by a helper, so filters on them go through this.
STALE: Final[dict[str, bool]] = {"stale_reason__isnull": False}
STALE_REASON: str = "stale_reason"


def with_stale_reason(
    queryset: QuerySet[WorkspaceRuntimeLease],
) -> QuerySet[WorkspaceRuntimeLease]:
    """Annotate `stale_reason` (one correlated, indexed lookup per row; no N+1 round trips)."""
    return queryset.alias(
        _owner_issue_ref=_owner_ref("issue"), _owner_run_ref=_owner_ref("run")
    ).annotate(stale_reason=stale_reason_expression())


def with_renewal_age(
    queryset: QuerySet[WorkspaceRuntimeLease],
) -> QuerySet[WorkspaceRuntimeLease]:
    """Annotate `renewal_age`: how long ago the owner last renewed, by database time (the
    app server's clock may differ from the one that stamped `renewed_at`)."""
    return queryset.annotate(
        renewal_age=ExpressionWrapper(Now() - F("renewed_at"), output_field=DurationField())
    )


def lease_renewal(lease: WorkspaceRuntimeLease) -> RenewalCadence:
    """The renewal cadence of a lease read through `with_renewal_age` (else by this server's
    clock, for a lease loaded some other way)."""
    age = getattr(lease, "renewal_age", None)
    if age is None:
        age = timezone.now() - lease.renewed_at
    return renewal_cadence(age=age, renewed_at=lease.renewed_at, expires_at=lease.expires_at)


def stale_candidate_ids() -> QuerySet[WorkspaceRuntimeLease, UUID]:
    """Ids of a superset of the stale leases, found without judging every row: the expired
    ones (through the `expiry_floor` index, docs/data-model.md#expiry-floor) and those whose
    `owner_stale` marker is set (through its partial index).

    The database keeps the marker for every write of a lease's key and every status change
    of the owner it names (leases/migrations/0002_owner_stale_marker.py), so a lease whose
    owner is stale by `stale_reason_expression` is always among them. Set-wide reads filter
    to these ids first and judge only them with the shared verdict, so "stale" still means the
    same everywhere; listing them reads only the stale rows, however many leases there are
    (docs/performance.md#cost-that-stays-flat).
    """
    leases = WorkspaceRuntimeLease.objects.order_by()
    # The floor is never above `expires_at` (a CHECK kept by triggers), so its index finds
    # every expired lease, and a few live ones whose floor the sweep has not moved up yet.
    expired = leases.filter(expiry_floor__lte=Now(), expires_at__lte=Now())
    return expired.values_list("pk", flat=True).union(
        leases.filter(owner_stale=True).values_list("pk", flat=True)
    )


class _IdAmongArray(Func):
    """`id = ANY(ARRAY(subquery))`: the subquery runs once, first (an InitPlan), and its ids
    are looked up through the primary key. As a plain `id IN (subquery)` the planner may judge
    every lease first and join afterwards: it cannot know that the candidates are few."""

    output_field = BooleanField()

    def as_sql(  # type: ignore[override]
        self, compiler: Any, connection: Any, **extra_context: Any
    ) -> tuple[str, tuple[Any, ...]]:
        column, subquery = self.get_source_expressions()
        lhs, lhs_params = compiler.compile(column)
        rhs, rhs_params = compiler.compile(subquery)  # "(SELECT ...)"
        return f"{lhs} = ANY(ARRAY{rhs})", (*lhs_params, *rhs_params)


def among_stale_candidates(
    queryset: QuerySet[WorkspaceRuntimeLease],
) -> QuerySet[WorkspaceRuntimeLease]:
    """`queryset` narrowed to `stale_candidate_ids`, for a set-wide stale read: filter it with
    STALE afterwards and only the candidates are judged."""
    return queryset.filter(_IdAmongArray(F("pk"), Subquery(stale_candidate_ids())))


def runtime_lease_evaluate_stale(*, lease_id: UUID) -> StaleReason | None:
    """The live stale reason of one lease (None when its owner is live or the lease is gone).

    Runs a fresh statement, so inside a claim it sees commits that happened while the caller
    waited for the row lock.
    """
    reason = (
        with_stale_reason(WorkspaceRuntimeLease.objects.filter(pk=lease_id))
        .values_list(STALE_REASON, flat=True)
        .first()
    )
    return cast("StaleReason | None", reason)


def runtime_lease_get(*, execution_workspace_id: UUID) -> RuntimeLeaseView:
    """The workspace's lease, if any, with its live stale reason (one query, no locks)."""
    lease = (
        with_stale_reason(WorkspaceRuntimeLease.objects.all())
        .filter(execution_workspace_id=execution_workspace_id)
        .first()
    )
    if lease is None:
        return RuntimeLeaseView(lease=None, stale_reason=None)
    return RuntimeLeaseView(
        lease=RuntimeLease.from_model(lease),
        stale_reason=cast("StaleReason | None", lease.stale_reason),  # type: ignore[attr-defined]
    )


def runtime_lease_stale_page(*, after_id: UUID | None, limit: int) -> list[tuple[UUID, str]]:
    """Up to `limit` stale leases as (id, reason), keyset-paginated by id (no locks).

    The sweep re-checks each candidate under its row lock before deleting it.
    """
    queryset = with_stale_reason(among_stale_candidates(WorkspaceRuntimeLease.objects.all()))
    queryset = queryset.filter(**STALE)
    if after_id is not None:
        queryset = queryset.filter(pk__gt=after_id)
    return [
        (lease_id, reason)
        for lease_id, reason in queryset.order_by("pk").values_list("pk", STALE_REASON)[:limit]
    ]
