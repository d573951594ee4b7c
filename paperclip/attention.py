"""What needs the board's attention: the shape of one dashboard tile, and the tiles of the core.

Each app that owns a kind of stuck work contributes its tiles as `TileSource`s built from its
own queryset builders (recovery's held finalizations, leases' stale leases, ...); the console
(recovery/console/attention.py) reads them in one table and adds nothing of its own, so a
tile's count and the admin list filter it links to always use the same builder. A source reads
a fixed number of queries whatever the number of rows and writes nothing. Database time
(`now()`) is the clock.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

from django.conf import settings
from django.db.models import Count, F, Min, QuerySet, Window

from paperclip.worker.health import freshest_worker_heartbeat

CompanyIds = Collection[UUID] | None  # None: every company (a superuser)


@dataclass(frozen=True, slots=True)
class AttentionTile:
    """One kind of stuck work: how many, and since when the oldest has been waiting."""

    kind: str  # e.g. finalization_held (docs/runbook.md#the-console lists them)
    title: str
    count: int
    oldest_at: datetime | None
    detail: str | None = None  # the stale reason, for `runtime_lease_stale`
    hint: str = ""


@dataclass(frozen=True, slots=True)
class AttentionScope:
    company_ids: CompanyIds
    now: datetime  # database time of the read


# The console list a tile opens, filtered to exactly the rows it counts: the admin URL name of
# a changelist and its query parameters (the list filter that uses the tile's own builder).
Link = tuple[str, dict[str, str]]


@dataclass(frozen=True, slots=True)
class TileSource:
    """The tiles of some kinds of stuck work: how to read them for a scope, and the list each
    opens (`link(kind, detail)`). `superusers_only`: the rows are not company-scoped (worker
    jobs name any company's runs)."""

    kinds: tuple[str, ...]
    read: Callable[[AttentionScope], Iterable[AttentionTile]]
    link: Callable[[str, str | None], Link]
    superusers_only: bool = False


def links(table: Mapping[str, Link]) -> Callable[[str, str | None], Link]:
    """A `TileSource.link` for tiles whose list does not depend on the tile's detail."""
    return lambda kind, detail: table[kind]


def scoped[M: QuerySet[Any]](queryset: M, company_ids: CompanyIds) -> M:
    if company_ids is None:
        return queryset
    return queryset.filter(company_id__in=list(company_ids))


def aggregate(queryset: QuerySet[Any], oldest: Any) -> tuple[int, datetime | None]:
    """How many rows, and the least value of `oldest` among them: one query."""
    row = queryset.order_by().aggregate(n=Count("pk"), oldest=Min(oldest))
    return int(row["n"]), row["oldest"]


def counted_tile(
    kind: str,
    title: str,
    hint: str,
    builder: Callable[[QuerySet[Any]], QuerySet[Any]],
    base: Callable[[], QuerySet[Any]],
    oldest: Any,
    link: Link,
) -> TileSource:
    """The common tile: `builder` applied to the scope's rows of `base()`, counted, with the
    least `oldest` as its age; it opens `link`."""

    def read(scope: AttentionScope) -> list[AttentionTile]:
        count, first = aggregate(builder(scoped(base(), scope.company_ids)), oldest)
        return [AttentionTile(kind, title, count, first, hint=hint)]

    return TileSource((kind,), read, links({kind: link}))


# --- The core's tiles: the worker -------------------------------------------------------------


def _failed_jobs(scope: AttentionScope) -> list[AttentionTile]:
    from procrastinate.contrib.django.models import ProcrastinateEvent, ProcrastinateJob

    count = ProcrastinateJob.objects.filter(status="failed").aggregate(n=Count("pk"))["n"]
    first = (
        ProcrastinateEvent.objects.filter(job__status="failed", type="failed")
        .aggregate(oldest=Min("at"))
        .get("oldest")
    )
    hint = "See the job's error; retry it from the job list."
    return [AttentionTile("job_failed", "Failed worker jobs", int(count), first, hint=hint)]


def _worker_heartbeat(scope: AttentionScope) -> list[AttentionTile]:
    heartbeat = freshest_worker_heartbeat()
    fresh_after = timedelta(seconds=settings.PAPERCLIP_WORKER_READY_SECONDS)
    fresh = heartbeat is not None and heartbeat > scope.now - fresh_after
    hint = (
        "A worker is alive."
        if fresh
        else "No worker heartbeat is fresh: finalizations and sweeps are not running."
    )
    return [
        AttentionTile(
            "worker_heartbeat_stale", "Worker heartbeat", 0 if fresh else 1, heartbeat, hint=hint
        )
    ]


# --- The core's tiles: workspaces whose cwd is behind their head ------------------------------


def _workspaces_behind(scope: AttentionScope) -> list[AttentionTile]:
    from paperclip.models import ExecutionWorkspace
    from paperclip.snapshots.behind import behind_for_attention, behind_since

    behind = behind_for_attention(scoped(ExecutionWorkspace.objects.all(), scope.company_ids))
    # One query: the count and age over every row (window aggregates), on the row of the
    # latest failure (failures first, newest first).
    top = (
        behind.annotate(n=Window(Count("pk")), oldest=Window(Min(behind_since())))
        .order_by(F("materialize_failed_at").desc(nulls_last=True), "pk")
        .values(
            "name",
            "materialize_error",
            "materialize_attempts",
            "materialize_next_at",
            "n",
            "oldest",
        )
        .first()
    )
    count, oldest = (int(top["n"]), top["oldest"]) if top is not None else (0, None)
    latest = top if top is not None and top["materialize_error"] is not None else None
    hint = (
        "The worker writes the head into the cwd; agents' checkouts read the store meanwhile. "
        "Fix what the error names, then Retry materialization now on the workspace."
    )
    if latest is not None:
        next_at = latest["materialize_next_at"]
        when = f"{next_at.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC" if next_at else "not scheduled"
        hint = (
            f"Latest: {latest['name']}: {(latest['materialize_error'] or '')[:300]} "
            f"(attempt {latest['materialize_attempts']}; next attempt {when}). {hint}"
        )
    return [
        AttentionTile(
            "workspace_behind_head", "Workspaces behind their head", count, oldest, hint=hint
        )
    ]


TILES: tuple[TileSource, ...] = (
    TileSource(
        ("workspace_behind_head",),
        _workspaces_behind,
        links(
            {
                "workspace_behind_head": (
                    "admin:paperclip_executionworkspace_changelist",
                    {"behind": "yes"},
                )
            }
        ),
    ),
    TileSource(
        ("job_failed",),
        _failed_jobs,
        links(
            {
                "job_failed": (
                    "admin:procrastinate_procrastinatejob_changelist",
                    {"status__exact": "failed"},
                )
            }
        ),
        superusers_only=True,
    ),
    TileSource(
        ("worker_heartbeat_stale",),
        _worker_heartbeat,
        links({"worker_heartbeat_stale": ("admin:paperclip_workerprocess_changelist", {})}),
    ),
)
