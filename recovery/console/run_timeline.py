"""A run's timeline for its console page, oldest first: its own start and end, lease claims
and the last renewal, workspace operations, the result and the finalization coordinator,
holds and other recovery actions, environment leases and the audit rows. Built from the rows
`run_related` already read (no query of its own)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from operator import attrgetter

from django.db.models import Model
from django.urls import reverse

from paperclip.admin.toolkit import short_id
from paperclip.models import HeartbeatRun
from recovery.console.run_related import RunRelated


@dataclass(frozen=True, slots=True)
class TimelineEntry:
    at: datetime
    kind: str  # "run", "lease", "operation", "finalization", "hold", "audit", ...
    text: str
    url: str | None = None


def _url(obj: Model) -> str:
    opts = obj._meta
    return reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[obj.pk])


def run_timeline(run: HeartbeatRun, related: RunRelated) -> list[TimelineEntry]:
    """Every dated step of `run` known from `related`, oldest first (ties keep this order:
    the run, leases, operations, coordinator, recovery actions, environment leases, audit)."""
    entries: list[TimelineEntry] = []

    def add(at: datetime | None, kind: str, text: str, url: str | None = None) -> None:
        if at is not None:
            entries.append(TimelineEntry(at=at, kind=kind, text=text, url=url))

    add(run.created_at, "run", f"run created ({run.runtime_mode})")
    add(run.started_at, "run", "run started")
    add(run.finished_at, "run", f"run ended: {run.status}")
    for row in related.runtime_leases:
        lease = row.lease
        url = _url(lease)
        workspace = f"{lease.execution_workspace.name} ({short_id(lease.execution_workspace_id)})"
        add(lease.claimed_at, "lease", f"claimed {workspace}, generation {lease.generation}", url)
        if lease.renewed_at != lease.claimed_at:
            add(lease.renewed_at, "lease", f"last renewal of {workspace} ({row.renewal.text})", url)
        add(lease.expires_at, "lease", f"lease on {workspace} expires", url)
    for op in related.operations:
        url = _url(op)
        add(op.started_at, "operation", f"operation {op.phase} started", url)
        exit_code = f", exit code {op.exit_code}" if op.exit_code is not None else ""
        add(op.finished_at, "operation", f"operation {op.phase} {op.status}{exit_code}", url)
    coordinator = related.coordinator
    if coordinator is not None:
        url = _url(coordinator)
        add(coordinator.created_at, "finalization", "finalization coordinator created", url)
        failure = f", last failure {coordinator.failure_code}" if coordinator.failure_code else ""
        add(
            coordinator.updated_at,
            "finalization",
            f"coordinator at phase {coordinator.phase} (attempt {coordinator.attempt}){failure}",
            url,
        )
    for action in related.recovery_actions:
        cause = action.cause.replace("_", " ")
        add(action.created_at, "hold", f"recovery action opened: {cause}", _url(action))
        if action.updated_at != action.created_at:
            add(
                action.updated_at, "hold", f"recovery action {action.status}: {cause}", _url(action)
            )
    for env in related.environment_leases:
        add(env.acquired_at, "environment", f"environment lease {env.provider} acquired", _url(env))
        add(env.released_at, "environment", f"environment lease {env.provider} released", _url(env))
    for event in related.activity:
        add(event.created_at, "audit", event.action, _url(event))
    entries.sort(key=attrgetter("at"))
    return entries
