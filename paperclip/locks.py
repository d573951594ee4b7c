"""Row-locking querysets of the core models: the only place that builds them.

Lock order for the rows of a run (a reviewed change to alter; see also `paperclip.db.advisory`
for the global order): advisory locks first, then

    issue -> coordinator (NativeRunFinalization) -> run -> recovery action

This is the order the recovery app's finalization commit and owner-stop confirmation use too
(docs/locking.md#lock-order); one order everywhere is what keeps a status update racing a
finalization commit from deadlocking. The issue comes before the run because a run moving to
`running` must check the issue's current execution holder before it commits to it. Code that
only needs the issue and the run (status transitions) takes `issue -> run`; nothing here ever
takes a run and then its issue, or a coordinator and then its issue.

All locks are `FOR NO KEY UPDATE` (`no_key=True`): none of these rows is deleted or re-keyed
under them, and the weaker lock lets foreign-key inserts pointing at the row (activity events,
workspace operations, results) proceed without waiting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from uuid import UUID

from django.contrib.auth import get_user_model
from django.db.models import QuerySet

from paperclip.db.locking import require_transaction
from paperclip.errors import NotFoundError, ResourceBusy
from paperclip.models import (
    AgentApiKey,
    BoardApiToken,
    HeartbeatRun,
    Issue,
    NativeRunFinalization,
)


def issues_for_update() -> QuerySet[Issue]:
    return Issue.objects.select_for_update(no_key=True, of=("self",)).order_by("pk")


def runs_for_update() -> QuerySet[HeartbeatRun]:
    return HeartbeatRun.objects.select_for_update(no_key=True, of=("self",)).order_by("pk")


def coordinators_for_update() -> QuerySet[NativeRunFinalization]:
    return NativeRunFinalization.objects.select_for_update(no_key=True, of=("self",)).order_by("pk")


def agent_keys_for_update() -> QuerySet[AgentApiKey]:
    return AgentApiKey.objects.select_for_update(no_key=True, of=("self",)).order_by("pk")


def board_tokens_for_update() -> QuerySet[BoardApiToken]:
    return BoardApiToken.objects.select_for_update(no_key=True, of=("self",)).order_by("pk")


def users_for_update() -> QuerySet[Any]:
    """Django users (the board): FOR UPDATE, as `create_board_token` may change the row."""
    return get_user_model().objects.select_for_update(of=("self",)).order_by("pk")


@dataclass(frozen=True, slots=True)
class LockedRun:
    """A run and its issue, both locked (issue first) and re-read under the locks."""

    run: HeartbeatRun
    issue: Issue | None
    coordinator: NativeRunFinalization | None = None


def run_lock_with_issue(
    *, run_id: UUID, attempts: int = 3, lock_coordinator: bool = False
) -> LockedRun:
    """Lock the run's issue (if any), then (if asked) its coordinator, then the run, inside the
    caller's transaction.

    The run's issue is only known after reading the run, so the run is read unlocked first, the
    issue locked, then the run locked and checked to still point at that issue (it can only
    change by the issue being deleted, which sets it NULL). Raises NotFoundError when the run is
    gone and ResourceBusy if the binding keeps moving.
    """
    require_transaction()
    for _ in range(attempts):
        issue_id = HeartbeatRun.objects.filter(pk=run_id).values_list("issue_id", flat=True).first()
        if issue_id is None and not HeartbeatRun.objects.filter(pk=run_id).exists():
            raise NotFoundError()
        issue = issues_for_update().filter(pk=issue_id).first() if issue_id is not None else None
        coordinator = (
            coordinators_for_update().filter(pk=run_id).first() if lock_coordinator else None
        )
        run = runs_for_update().filter(pk=run_id).first()
        if run is None:
            raise NotFoundError()
        if run.issue_id == (issue.pk if issue is not None else None):
            return LockedRun(run=run, issue=issue, coordinator=coordinator)
    raise ResourceBusy(run_id=str(run_id))


def workspace_cwds_key() -> str:
    """The advisory key every write of a workspace's `cwd` takes: the check that a new `cwd`
    is no other company's sees every `cwd` committed before it, none written beside it."""
    return "paperclip:workspace-cwds"
