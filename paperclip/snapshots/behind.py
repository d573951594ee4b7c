"""Workspaces whose cwd is behind their head (docs/snapshots.md#when-materialization-fails).

The materialization job (recovery's worker task, deferred here by name) makes a cwd hold its
workspace's head. When it fails (a full disk, an unwritable cwd, a blob that cannot be read)
the failure is recorded on the workspace with the time of the next attempt, which the periodic
reconciler honours (back-off: 30 s, doubling, at most 30 min); a success clears it. The
console's "Workspaces behind their head" tile and the workspace list's filter read the same
builder, and "Retry materialization now" defers the job at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final, Literal
from uuid import UUID

from django.db import connection, transaction
from django.db.models import F, Q, QuerySet
from django.db.models.functions import Coalesce, Now

from paperclip.activity import activity_record
from paperclip.db.locking import require_transaction
from paperclip.errors import NotFoundError
from paperclip.models import ExecutionWorkspace
from paperclip.worker.jobs import job_defer_in_tx

MATERIALIZE_TASK: Final = "materialize_workspace"
MATERIALIZER: Final = "workspace_publisher"  # the system actor of materialization's audit rows
RETRY_FIRST_SECONDS: Final = 30
RETRY_MAX_SECONDS: Final = 1800
# A materialization normally ends within a second of the head's move: a cwd behind for longer
# than this (or whose last attempt failed) is shown on the console.
BEHIND_GRACE: Final = timedelta(seconds=60)
MAX_ERROR_CHARS: Final = 2000


class WorkspaceNotFound(NotFoundError):
    message = "Execution workspace not found."


def materialize_queueing_lock(workspace_id: UUID) -> str:
    return f"materialize-workspace:{workspace_id}"


def materialize_defer_in_tx(*, workspace_id: UUID) -> int | None:
    """Defer the workspace's materialization job (None when one is already waiting)."""
    require_transaction()
    return job_defer_in_tx(
        MATERIALIZE_TASK,
        queueing_lock=materialize_queueing_lock(workspace_id),
        workspace_id=str(workspace_id),
    )


def behind_head(queryset: QuerySet[ExecutionWorkspace]) -> QuerySet[ExecutionWorkspace]:
    """Workspaces with a cwd that does not hold their head (yet), whatever the reason."""
    return (
        queryset.filter(cwd__isnull=False, head_tree__isnull=False)
        .exclude(cwd="")
        .filter(Q(cwd_tree__isnull=True) | ~Q(cwd_tree=F("head_tree")))
    )


def behind_for_attention(
    queryset: QuerySet[ExecutionWorkspace],
) -> QuerySet[ExecutionWorkspace]:
    """Those of `behind_head` an operator should look at: the last attempt failed, or the head
    moved more than BEHIND_GRACE ago (database time) and the cwd still does not hold it."""
    return behind_head(queryset).filter(
        Q(materialize_error__isnull=False)
        | Q(head_committed_at__isnull=True)
        | Q(head_committed_at__lt=Now() - BEHIND_GRACE)
    )


def behind_since() -> Coalesce:
    """Since when a workspace has been behind, for the tile's age."""
    return Coalesce("head_committed_at", "updated_at")


def due_for_attempt(queryset: QuerySet[ExecutionWorkspace]) -> QuerySet[ExecutionWorkspace]:
    """Those whose recorded failure's back-off has passed (or that have none)."""
    return queryset.filter(Q(materialize_next_at__isnull=True) | Q(materialize_next_at__lte=Now()))


@dataclass(frozen=True, slots=True)
class MaterializeFailure:
    attempts: int  # failures in a row, this one included
    next_at: datetime


def materialize_failure_record(
    *,
    company_id: UUID,
    workspace_id: UUID,
    tree: str,
    previous_tree: str | None,
    cwd: str,
    error: str,
) -> MaterializeFailure | None:
    """Record that materializing `tree` into the workspace's cwd failed with `error`: one more
    attempt in a row, the next one after the back-off (database time); one
    `workspace.materialize_failed` audit row. `cwd_tree` is left as the round marked it before
    its first write (unknown: the cwd may hold part of `tree`). None when the workspace is
    gone."""
    error = error[:MAX_ERROR_CHARS]
    with transaction.atomic(durable=True):
        with connection.cursor() as cursor:
            # Every SET expression reads the row as it was: the back-off doubles per failure.
            cursor.execute(
                "UPDATE execution_workspaces SET materialize_error = %s,"
                " materialize_failed_at = now(),"
                " materialize_attempts = materialize_attempts + 1,"
                " materialize_next_at = now() + make_interval(secs => least("
                "   %s * power(2, least(materialize_attempts, 20)), %s)),"
                " updated_at = now()"
                " WHERE id = %s AND company_id = %s"
                " RETURNING materialize_attempts, materialize_next_at",
                [error, RETRY_FIRST_SECONDS, RETRY_MAX_SECONDS, workspace_id, company_id],
            )
            row = cursor.fetchone()
        if row is None:
            return None
        failure = MaterializeFailure(attempts=int(row[0]), next_at=row[1])
        activity_record(
            company_id=company_id,
            actor_type="system",
            actor_id=MATERIALIZER,
            action="workspace.materialize_failed",
            entity_type="execution_workspace",
            entity_id=workspace_id,
            details={
                "tree": tree,
                "previousTree": previous_tree,
                "cwd": cwd,
                "error": error,
                "attempts": failure.attempts,
                "nextAttemptAt": failure.next_at.isoformat(),
            },
        )
    return failure


# What a successful materialization clears, in the update that records the new cwd_tree.
FAILURE_CLEARED: Final = {
    "materialize_error": None,
    "materialize_failed_at": None,
    "materialize_attempts": 0,
    "materialize_next_at": None,
}


type RetryStatus = Literal["deferred", "already_queued", "current", "no_cwd"]


@dataclass(frozen=True, slots=True)
class MaterializeRetry:
    status: RetryStatus
    job_id: int | None = None
    head: str | None = None
    cwd_tree: str | None = None


def workspace_materialize_retry(
    *, workspace_id: UUID, company_ids: list[UUID] | None, actor_id: str
) -> MaterializeRetry:
    """The board's "Retry materialization now": defer the workspace's materialization job at
    once, whatever its back-off, and make the reconciler's next pass due too.

    `current` (the cwd holds the head), `no_cwd` and `already_queued` (a job is waiting: it
    runs next) write nothing; `deferred` (with the job's id) writes the job, the due time and
    one `workspace.materialize_retry_requested` audit row. Raises WorkspaceNotFound for a
    workspace outside `company_ids` (None: any)."""
    with transaction.atomic(durable=True):
        rows = ExecutionWorkspace.objects.filter(pk=workspace_id)
        if company_ids is not None:
            rows = rows.filter(company_id__in=company_ids)
        row = rows.values("company_id", "cwd", "head_tree", "cwd_tree").first()
        if row is None:
            raise WorkspaceNotFound(workspace_id=str(workspace_id))
        head, cwd_tree = row["head_tree"], row["cwd_tree"]
        if not row["cwd"]:
            return MaterializeRetry("no_cwd", head=head, cwd_tree=cwd_tree)
        if head is None or head == cwd_tree:
            return MaterializeRetry("current", head=head, cwd_tree=cwd_tree)
        job_id = materialize_defer_in_tx(workspace_id=workspace_id)
        if job_id is None:
            return MaterializeRetry("already_queued", head=head, cwd_tree=cwd_tree)
        ExecutionWorkspace.objects.filter(pk=workspace_id).update(materialize_next_at=Now())
        activity_record(
            company_id=row["company_id"],
            actor_type="user",
            actor_id=actor_id,
            action="workspace.materialize_retry_requested",
            entity_type="execution_workspace",
            entity_id=workspace_id,
            details={"tree": head, "cwdTree": cwd_tree, "jobId": job_id, "via": "admin"},
        )
    return MaterializeRetry("deferred", job_id=job_id, head=head, cwd_tree=cwd_tree)
