"""Where a run's finalization stands (the Run JSON's `finalization` block, the admin, `?wait=`).

Read-only: derived from the coordinator, the owner-unverified hold, the run's finalization jobs,
the worker heartbeats and the finalization advisory lock (read from `pg_locks`, never taken).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal
from uuid import UUID

from django.conf import settings
from procrastinate.contrib.django.models import ProcrastinateWorker

from paperclip.db.advisory import advisory_lock_held
from paperclip.db.clock import db_now
from paperclip.db.notify import FINALIZATION_CHANNEL, listening
from paperclip.models import HeartbeatRun, NativeRunFinalization
from paperclip.receipts import raw_owner
from paperclip.worker.jobs import PendingJob, job_status, pending_jobs
from recovery.locks import finalization_lock_key, finalization_queueing_lock
from recovery.models import LIVE_STATUSES, IssueRecoveryAction
from recovery.selectors.actions import (
    HEAD_CONFLICT_CODE,
    OWNER_UNVERIFIED_CAUSE,
    WAITING_PHASES,
    current_owner_fingerprint,
)

AWAIT_POLL_FIRST = 0.05  # seconds before the second read when no notification comes
AWAIT_POLL_MAX = 0.5  # and the longest interval between reads, growing from the first

FinalizationStateName = Literal[
    "none", "waiting", "queued", "running", "retry_scheduled", "held", "failed", "committed"
]


@dataclass(frozen=True, slots=True)
class FinalizationState:
    state: FinalizationStateName
    reason: str | None  # the NotAcquired reason while held
    attempts: int
    next_attempt_at: datetime | None
    last_error: str | None
    job: PendingJob | None  # the job that will (or does) attempt it

    def as_json(self) -> dict[str, object]:
        return {
            "state": self.state,
            "reason": self.reason,
            "attempts": self.attempts,
            "next_attempt_at": self.next_attempt_at,
            "last_error": self.last_error,
        }


def _last_error(coordinator: NativeRunFinalization) -> str | None:
    if not coordinator.failure_code:
        return None
    detail = coordinator.failure_detail if isinstance(coordinator.failure_detail, dict) else {}
    cause, text = detail.get("code"), detail.get("detail")
    parts = [coordinator.failure_code, *(str(p) for p in (cause, text) if p)]
    return ": ".join(parts)


def owner_hold_live(*, company_id: UUID, run_id: UUID) -> bool:
    """An owner-unverified hold waits for the board on this run: live, its stop not confirmed
    yet, and naming the owner receipt the run carries now.

    A hold whose owner is no longer the run's receipt (that owner released it, a takeover
    replaced it, a later owner claimed it) holds nothing: the board could not confirm it (the
    confirmation is refused `owner_changed`), so the run is not kept waiting for it. The next
    attempt meets the current receipt and either holds the run for that owner (superseding the
    old hold) or commits (resolving it)."""
    current_owner = current_owner_fingerprint(company_id=company_id, run_id=run_id)
    if current_owner is None:
        return False
    return (
        IssueRecoveryAction.objects.filter(
            company_id=company_id,
            cause=OWNER_UNVERIFIED_CAUSE,
            status__in=LIVE_STATUSES,
            evidence__runId=str(run_id),
            fingerprint=current_owner,
        )
        .exclude(evidence__has_key="workspaceOwnerStop")
        .exists()
    )


def _worker_alive(job: PendingJob) -> bool:
    if job.worker_id is None:
        return False
    cutoff = db_now() - timedelta(seconds=settings.PAPERCLIP_WORKER_STALLED_AFTER_SECONDS)
    return ProcrastinateWorker.objects.filter(id=job.worker_id, last_heartbeat__gt=cutoff).exists()


def finalization_state(
    run: HeartbeatRun, *, coordinator: NativeRunFinalization | None = None
) -> FinalizationState:
    """The run's finalization state:

    - `none`: no accepted result; `committed`: done;
    - `running`: a live owner holds the finalization lock, or a worker with a fresh heartbeat
      runs its job;
    - `held`: waiting for the board (reason `owner_unverified`, or `platform_stop_pending`
      while the worker platform has not reported the prior worker stopped, or
      `workspace_head_conflict` when the run's changes overlap another run's);
    - `queued`: a job will start it now; `retry_scheduled`: a retry waits for
      `next_attempt_at` (database clock);
    - `failed`: the retry budget is spent, waiting for an explicit finalize;
    - `waiting`: due, but no job is waiting (the reconciler defers one within its interval).
    """
    if coordinator is None:
        coordinator = NativeRunFinalization.objects.filter(
            run_id=run.pk, company_id=run.company_id
        ).first()
    if coordinator is None or coordinator.result_id is None:
        return FinalizationState("none", None, 0, None, None, None)
    attempts, error = coordinator.attempt, _last_error(coordinator)
    if coordinator.phase == NativeRunFinalization.Phase.COMMITTED:
        return FinalizationState("committed", None, attempts, None, None, None)
    jobs = pending_jobs(finalization_queueing_lock(run.pk))
    running = next((j for j in jobs if j.status == "doing" and _worker_alive(j)), None)
    waiting = next((j for j in jobs if j.status == "todo"), None)
    if running is not None or advisory_lock_held(finalization_lock_key(run.company_id, run.pk)):
        return FinalizationState("running", None, attempts, None, error, running)
    if coordinator.failure_code == HEAD_CONFLICT_CODE:
        return FinalizationState("held", HEAD_CONFLICT_CODE, attempts, None, error, waiting)
    if owner_hold_live(company_id=run.company_id, run_id=run.pk):
        receipt = raw_owner(run.runner_profile_json)
        pending_platform = isinstance(receipt, dict) and receipt.get("worker") is not None
        reason = "platform_stop_pending" if pending_platform else "owner_unverified"
        return FinalizationState("held", reason, attempts, None, error, waiting)
    now = db_now()
    if waiting is not None:
        if waiting.scheduled_at is not None and waiting.scheduled_at > now:
            return FinalizationState(
                "retry_scheduled", None, attempts, waiting.scheduled_at, error, waiting
            )
        return FinalizationState("queued", None, attempts, None, error, waiting)
    if coordinator.phase == NativeRunFinalization.Phase.RETRYABLE_FAILURE:
        return FinalizationState("failed", None, attempts, None, error, None)
    due = coordinator.next_attempt_at
    if coordinator.phase in WAITING_PHASES and due is not None and due > now:
        return FinalizationState("retry_scheduled", None, attempts, due, error, None)
    return FinalizationState("waiting", None, attempts, None, error, None)


def finalization_await(
    *, company_id: UUID, run_id: UUID, job_id: int | None, timeout: float
) -> FinalizationState:
    """Wait up to `timeout` seconds for the attempt of job `job_id` to end (`?wait=`): return as
    soon as the run is committed, or once that job ended (following the job it left waiting,
    if any) and the run is held, failed or scheduled for a retry; otherwise the state when the
    time ran out. Reads only. Woken when the worker's finalization job for the run ends (a
    notification, `paperclip.db.notify`); between those, it reads the state again at a
    growing interval (`AWAIT_POLL_FIRST` up to `AWAIT_POLL_MAX` seconds), which is all it has when a
    commit is made elsewhere or a notification is lost."""
    deadline = time.monotonic() + timeout
    interval = AWAIT_POLL_FIRST
    with listening(FINALIZATION_CHANNEL) as wait:
        while True:
            run = HeartbeatRun.objects.get(pk=run_id, company_id=company_id)
            current = finalization_state(run)
            if current.state == "committed":
                return current
            if job_id is None or job_status(job_id) not in ("todo", "doing"):
                if current.state in ("held", "failed", "retry_scheduled"):
                    return current
                # The attempt ended without an answer (another owner is at work, or it left
                # a follow-up job): follow whatever job carries the run on.
                job_id = current.job.id if current.job is not None else None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return current
            wait(min(interval, remaining), str(run_id))
            interval = min(interval * 1.5, max(AWAIT_POLL_MAX, AWAIT_POLL_FIRST))
