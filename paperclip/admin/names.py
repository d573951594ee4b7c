"""Names beside ids on every app's admin pages: "run of agent-3 (73bf1a2c)" rather than a bare
uuid, and the batch lookup behind pages whose ids are not foreign keys (job arguments, audit
rows): one query per kind of object present, whatever the number of rows; reads only.

The core's kinds live here; the console adds the other apps' (recovery.console.names).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from django.contrib import admin
from django.db.models import Model
from django.utils.safestring import SafeString

from paperclip.admin.toolkit import named_link
from paperclip.models import Agent, Company, ExecutionWorkspace, HeartbeatRun, Issue


def run_name(run: HeartbeatRun) -> str:
    """`run of agent-3` (the run's agent must be loaded: select_related("run__agent"))."""
    return f"run of {run.agent.name}"


def run_link(run: HeartbeatRun | None, *, limit: int = 24) -> SafeString | str:
    """A link to the run's page, labelled `run of agent-3 (73bf1a2c)`."""
    if run is None:
        return "—"
    return named_link(HeartbeatRun, run.pk, run_name(run), limit=limit)


def issue_link(issue: Issue | None, *, limit: int = 32) -> SafeString | str:
    """A link to the issue's page, labelled with its title beside its short id."""
    if issue is None:
        return "—"
    return named_link(Issue, issue.pk, issue.title, limit=limit)


def workspace_link(workspace: ExecutionWorkspace | None, *, limit: int = 24) -> SafeString | str:
    """A link to the execution workspace's page, labelled with its name beside its short id."""
    if workspace is None:
        return "—"
    return named_link(ExecutionWorkspace, workspace.pk, workspace.name, limit=limit)


class RunIssueColumns:
    """The `run_named` and `issue_named` columns of a list whose rows have `run` and `issue`
    (select_related("run__agent", "issue"))."""

    @admin.display(description="run", ordering="run__agent__name")
    def run_named(self, obj: Any) -> SafeString | str:
        return run_link(obj.run)

    @admin.display(description="issue", ordering="issue__title")
    def issue_named(self, obj: Any) -> SafeString | str:
        return issue_link(obj.issue)


@dataclass(frozen=True, slots=True)
class NameKind:
    """A kind of object named by id: its model, how one is named, and what naming it reads."""

    model: type[Model]
    name: Callable[[Any], str]
    related: tuple[str, ...] = ()


CORE_KINDS: dict[str, NameKind] = {
    "company": NameKind(Company, lambda o: o.name),
    "agent": NameKind(Agent, lambda o: o.name),
    "issue": NameKind(Issue, lambda o: o.title),
    "heartbeat_run": NameKind(HeartbeatRun, run_name, ("agent",)),
    "execution_workspace": NameKind(ExecutionWorkspace, lambda o: o.name),
}


def names_by_kind(
    wanted: Mapping[str, Iterable[UUID]], kinds: Mapping[str, NameKind]
) -> dict[tuple[str, UUID], str]:
    """The names of the `wanted` ids of each kind (one query per kind with ids); ids whose row
    is gone are absent."""
    names: dict[tuple[str, UUID], str] = {}
    for kind_name, ids in sorted(wanted.items()):
        ids = set(ids)
        if not ids:
            continue
        kind = kinds[kind_name]
        rows = kind.model._default_manager.filter(pk__in=ids)
        if kind.related:
            rows = rows.select_related(*kind.related)
        for obj in rows:
            names[(kind_name, obj.pk)] = kind.name(obj)
    return names
