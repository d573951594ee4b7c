"""Writes of heartbeat runs: creating them and moving them along their lifecycle.

Run lifecycle (`run_transition`):

    queued  -> running | cancelled | failed | timed_out | interrupted
    running -> succeeded | failed | cancelled | timed_out | interrupted
    terminal (succeeded, failed, cancelled, timed_out, interrupted) -> nothing

`queued -> succeeded` is refused: a run that never started has not done its work. Asking for the
status a run already has is an idempotent no-op (no audit row). A native run whose result has
been accepted reaches its terminal status only through finalization: no status update ends it,
and a later run starting on its issue takes the issue's slots from it without interrupting it
(docs/recovery.md#runs-whose-result-was-accepted).

Composable helpers for other apps (they run inside the caller's transaction, never open one):
`_run_start_in_tx` and `run_finish_in_tx`; lock with `paperclip.locks.run_lock_with_issue`
first (lock order: issue -> coordinator -> run, see `paperclip.locks`).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from django.db import transaction
from django.db.models.functions import Now

from paperclip import selectors
from paperclip.access import Actor
from paperclip.activity import row_update_audited
from paperclip.db.locking import busy_on_lock_timeout, require_transaction, set_local_lock_timeout
from paperclip.errors import (
    AgentNotActive,
    InvalidRequest,
    InvalidRunTransition,
    IssueExecutionLocked,
    NotFoundError,
    PermissionDenied,
)
from paperclip.locks import run_lock_with_issue, runs_for_update
from paperclip.models import (
    Agent,
    ExecutionWorkspace,
    HeartbeatRun,
    Issue,
    NativeRunFinalization,
    NativeRunResult,
)
from paperclip.services.shared import absolute_path_error, audit

RunStatus = HeartbeatRun.Status


RUN_TRANSITIONS: dict[str, frozenset[str]] = {
    RunStatus.QUEUED: frozenset(
        {
            RunStatus.RUNNING,
            RunStatus.CANCELLED,
            RunStatus.FAILED,
            RunStatus.TIMED_OUT,
            RunStatus.INTERRUPTED,
        }
    ),
    RunStatus.RUNNING: frozenset(
        {
            RunStatus.SUCCEEDED,
            RunStatus.FAILED,
            RunStatus.CANCELLED,
            RunStatus.TIMED_OUT,
            RunStatus.INTERRUPTED,
        }
    ),
}


# Coordinator phases at or after result acceptance: the run's success belongs to finalization.
RESULT_ACCEPTED_PHASES = frozenset(
    {
        NativeRunFinalization.Phase.RESULT_ACCEPTED,
        NativeRunFinalization.Phase.WORKSPACE_FINALIZING,
        NativeRunFinalization.Phase.COMMITTED,
        NativeRunFinalization.Phase.APPLIED,
    }
)


@dataclass(frozen=True, slots=True)
class RunCreated:
    run: HeartbeatRun
    finalization: NativeRunFinalization | None  # the coordinator of a native run


def run_create(
    *,
    actor: Actor,
    runtime_mode: str,
    agent_id: UUID | None = None,
    issue_id: UUID | None = None,
    execution_workspace_id: UUID | None = None,
    workspace_dir: str | None = None,
) -> RunCreated:
    """Queue a heartbeat run for an agent (an agent: for itself; a board: `agent_id` required).

    A native run needs an issue: it is bound as both `issue` and `native_issue`, gets a fresh
    `completion_contract_id`, and its coordinator (NativeRunFinalization, phase `observed`) is
    created in the same transaction. `workspace_dir` goes to
    `runner_profile_json.nativeExecutionInput.binding.workspaceDir`.

    Raises InvalidRequest (bad mode, missing agent_id / issue_id, bad workspace_dir),
    PermissionDenied (an agent asking for another agent), NotFoundError (agent, issue or
    workspace not visible or not in the agent's company), AgentNotActive.
    """
    _run_create_validate(
        actor=actor,
        runtime_mode=runtime_mode,
        agent_id=agent_id,
        issue_id=issue_id,
        workspace_dir=workspace_dir,
    )
    agent = _run_agent(actor, agent_id)

    native = runtime_mode == HeartbeatRun.RuntimeMode.NATIVE
    with transaction.atomic(durable=True):
        issue, workspace = _run_related(agent, issue_id, execution_workspace_id)
        profile: dict[str, Any] = {}
        if workspace_dir is not None:
            profile["nativeExecutionInput"] = {"binding": {"workspaceDir": workspace_dir}}
        run = HeartbeatRun.objects.create(
            company_id=agent.company_id,
            agent=agent,
            issue=issue,
            native_issue=issue if native else None,
            status=RunStatus.QUEUED,
            runtime_mode=runtime_mode,
            execution_workspace=workspace,
            completion_contract_id=uuid.uuid4() if native else None,
            context_snapshot={
                "issueId": str(issue.pk) if issue else None,
                "executionWorkspaceId": str(workspace.pk) if workspace else None,
            },
            runner_profile_json=profile,
        )
        finalization = None
        if native and issue is not None:  # issue_id is required for native runs (checked above)
            finalization = NativeRunFinalization.objects.create(
                run=run,
                company_id=agent.company_id,
                issue=issue,
                phase=NativeRunFinalization.Phase.OBSERVED,
            )
        audit(
            actor,
            company_id=agent.company_id,
            action="heartbeat_run.created",
            entity_type="heartbeat_run",
            entity_id=run.pk,
            run_id=run.pk,
            details={
                "agent_id": str(agent.pk),
                "runtime_mode": runtime_mode,
                "issue_id": str(issue.pk) if issue else None,
                "execution_workspace_id": str(workspace.pk) if workspace else None,
            },
        )
        run.refresh_from_db()
    return RunCreated(run=run, finalization=finalization)


def _run_create_validate(
    *,
    actor: Actor,
    runtime_mode: str,
    agent_id: UUID | None,
    issue_id: UUID | None,
    workspace_dir: str | None,
) -> None:
    """Database-free checks of a new run; InvalidRequest naming every bad field."""
    fields: dict[str, list[str]] = {}
    if runtime_mode not in HeartbeatRun.RuntimeMode.values:
        fields["runtime_mode"] = [f'"{runtime_mode}" is not a valid choice.']
    if runtime_mode == HeartbeatRun.RuntimeMode.NATIVE and issue_id is None:
        fields["issue_id"] = ["Required for native runs."]
    if workspace_dir is not None and (problem := absolute_path_error(workspace_dir)):
        fields["workspace_dir"] = [problem]
    if actor.is_board and agent_id is None:
        fields["agent_id"] = ["Required when a board member creates a run."]
    if fields:
        raise InvalidRequest(fields=fields)


def _run_agent(actor: Actor, agent_id: UUID | None) -> Agent:
    """The agent the run is for (an agent: itself), visible to the actor and active."""
    if actor.is_agent:
        if agent_id is not None and agent_id != actor.agent_id:
            raise PermissionDenied("An agent can only create runs for itself.")
        agent_id = actor.agent_id
    if agent_id is None:  # pragma: no cover - rejected above for boards; agents have an id
        raise InvalidRequest(fields={"agent_id": ["Required."]})
    agent = selectors.agent_get(actor=actor, agent_id=agent_id)
    if agent.status != Agent.Status.ACTIVE:
        raise AgentNotActive(agent_id=str(agent.pk), status=agent.status)
    return agent


def _run_related(
    agent: Agent, issue_id: UUID | None, execution_workspace_id: UUID | None
) -> tuple[Issue | None, ExecutionWorkspace | None]:
    """The run's issue and workspace: related rows must be in the agent's company, whatever
    else the actor may see."""
    issue = None
    if issue_id is not None:
        issue = Issue.objects.filter(pk=issue_id, company_id=agent.company_id).first()
        if issue is None:
            raise NotFoundError("The issue was not found in the agent's company.")
    workspace = None
    if execution_workspace_id is not None:
        workspace = ExecutionWorkspace.objects.filter(
            pk=execution_workspace_id, company_id=agent.company_id
        ).first()
        if workspace is None:
            raise NotFoundError("The execution workspace was not found in the agent's company.")
    return issue, workspace


@dataclass(frozen=True, slots=True)
class RunTransition:
    run: HeartbeatRun
    from_status: str
    changed: bool  # False when the run already had the requested status


def _run_has_accepted_result(run: HeartbeatRun, coordinator: NativeRunFinalization | None) -> bool:
    """Whether a native run's result has been accepted (the caller holds the coordinator)."""
    if coordinator is not None and (
        coordinator.result_id is not None or coordinator.phase in RESULT_ACCEPTED_PHASES
    ):
        return True
    return NativeRunResult.objects.filter(
        run_id=run.pk, schema_status=NativeRunResult.SchemaStatus.ACCEPTED
    ).exists()


def run_transition(*, actor: Actor, run_id: UUID | str, to_status: str) -> RunTransition:
    """Move a run along its lifecycle (see the module docstring).

    Allowed for the run's own agent or a board member of its company. Locks, in order: the
    issue, the coordinator (only for a native run asked to succeed), the run; hot-path lock
    timeout 5 s. Moving to `running` takes the issue's execution and checkout slots; reaching a
    terminal status frees them.

    Raises InvalidRequest (unknown status), NotFoundError, PermissionDenied (another agent),
    InvalidRunTransition (422), IssueExecutionLocked (409: another live run holds the issue),
    ResourceBusy (409: lock wait timed out; retry).
    """
    if to_status not in RunStatus.values:
        raise InvalidRequest(fields={"status": [f'"{to_status}" is not a valid choice.']})
    visible = selectors.run_get(actor=actor, run_id=run_id)
    if actor.is_agent and visible.agent_id != actor.agent_id:
        raise PermissionDenied("Only the run's own agent may change its status.")

    with busy_on_lock_timeout(run_id=str(visible.pk)), transaction.atomic(durable=True):
        set_local_lock_timeout()
        # A native run whose result was accepted reaches its terminal status (the one its result
        # names) through finalization only: no PATCH, and no successor, ends it meanwhile.
        check_result = (
            to_status in HeartbeatRun.TERMINAL_STATUSES
            and visible.runtime_mode == HeartbeatRun.RuntimeMode.NATIVE
        )
        # The coordinator is locked (issue -> coordinator -> run) so a result cannot be accepted
        # between the check and the status write.
        locked = run_lock_with_issue(run_id=visible.pk, lock_coordinator=check_result)
        run, issue = locked.run, locked.issue
        accepted = check_result and _run_has_accepted_result(run, locked.coordinator)
        from_status = run.status
        if from_status == to_status:
            return RunTransition(run=run, from_status=from_status, changed=False)
        if to_status not in RUN_TRANSITIONS.get(from_status, frozenset()):
            raise InvalidRunTransition(
                f"A {from_status} run cannot become {to_status}.",
                run_id=str(run.pk),
                from_status=from_status,
                to_status=to_status,
            )
        if accepted:
            raise InvalidRunTransition(
                "This native run has an accepted result; it reaches its terminal status through "
                "finalization, not by a status update.",
                remediation="Finalize the run (POST /api/heartbeat-runs/{run_id}/finalize).",
                run_id=str(run.pk),
                from_status=from_status,
                to_status=to_status,
            )
        if to_status == RunStatus.RUNNING:
            _run_start_in_tx(
                run=run, issue=issue, actor_type=actor.actor_type, actor_id=actor.actor_id
            )
        else:
            run_finish_in_tx(
                run=run, to_status=to_status, actor_type=actor.actor_type, actor_id=actor.actor_id
            )
    return RunTransition(run=run, from_status=from_status, changed=True)


@dataclass(frozen=True, slots=True)
class HolderLiveness:
    """What keeps a run that holds an issue alive, as the leases app judges it."""

    orphaned: bool  # every lease lapsed, no accepted result: its agent is gone
    last_renewed_at: datetime | None
    orphaned_at: datetime | None  # when it became, or would become, orphaned


_liveness_judge: Callable[[UUID], HolderLiveness] | None = None


def run_liveness_judge_register(judge: Callable[[UUID], HolderLiveness]) -> None:
    """The app that keeps runs' leases (leases) judges a holder's liveness for run starts."""
    global _liveness_judge
    _liveness_judge = judge


def _take_over_orphaned_holder(
    *, holder_id: UUID, run: HeartbeatRun, actor_type: str, actor_id: str
) -> HolderLiveness | None:
    """Interrupt the holder if it is orphaned (returns None then), else its liveness."""
    if _liveness_judge is None:
        return None
    liveness = _liveness_judge(holder_id)
    if not liveness.orphaned:
        return liveness
    holder = runs_for_update().filter(pk=holder_id).first()
    if holder is not None and not holder.is_terminal:
        run_finish_in_tx(
            run=holder,
            to_status=RunStatus.INTERRUPTED,
            actor_type=actor_type,
            actor_id=actor_id,
            details={"reason": "orphaned", "interruptedForRunId": str(run.pk)},
        )
    return None


def _run_start_in_tx(
    *, run: HeartbeatRun, issue: Issue | None, actor_type: str, actor_id: str
) -> None:
    """Move a locked queued run to `running`, taking its issue's execution and checkout slots.

    Runs inside the caller's transaction with the issue and then the run locked
    (`run_lock_with_issue`). Raises IssueExecutionLocked while another live run holds either
    slot; a terminal holder is simply replaced. Writes the audit row; refreshes `run`.
    """
    require_transaction()
    from_status = run.status
    taken_from: list[str] = []
    if issue is not None:
        slot_ids = {
            pk for pk in (issue.execution_run_id, issue.checkout_run_id) if pk not in (None, run.pk)
        }
        # A holder whose result was accepted has done its work; only its finalization waits
        # (perhaps for the board). It keeps its status and its finalization, and hands the
        # issue's slots to this run instead of blocking it or being interrupted by it.
        finished = set(
            NativeRunFinalization.objects.filter(run_id__in=slot_ids, result_id__isnull=False)
            .exclude(phase=NativeRunFinalization.Phase.COMMITTED)
            .values_list("run_id", flat=True)
        )
        holder_ids = sorted(pk for pk in slot_ids if pk not in finished)
        taken_from = sorted(str(pk) for pk in slot_ids if pk in finished)
        holder = (
            HeartbeatRun.objects.filter(pk__in=holder_ids, status__in=HeartbeatRun.LIVE_STATUSES)
            .order_by("pk")
            .values("pk", "status")
            .first()
        )
        if holder is not None:
            # An orphaned holder (its agent died) is interrupted here, in this transaction,
            # and the start goes on; a live one is named, with when it would count as orphaned.
            liveness = _take_over_orphaned_holder(
                holder_id=holder["pk"], run=run, actor_type=actor_type, actor_id=actor_id
            )
            still = (
                HeartbeatRun.objects.filter(
                    pk__in=holder_ids, status__in=HeartbeatRun.LIVE_STATUSES
                )
                .order_by("pk")
                .values("pk", "status", "agent_id")
                .first()
            )
            if still is not None:
                raise IssueExecutionLocked(
                    issue_id=str(issue.pk),
                    holder_run_id=str(still["pk"]),
                    holder_status=still["status"],
                    holder_agent_id=str(still["agent_id"]),
                    last_renewed_at=_iso(liveness.last_renewed_at if liveness else None),
                    orphaned_at=_iso(liveness.orphaned_at if liveness else None),
                )
        Issue.objects.filter(pk=issue.pk).update(
            execution_run=run, checkout_run=run, execution_locked_at=Now(), updated_at=Now()
        )
        issue.refresh_from_db()
    row_update_audited(
        run,
        {"status": RunStatus.RUNNING, "started_at": Now(), "updated_at": Now()},
        company_id=run.company_id,
        actor_type=actor_type,
        actor_id=actor_id,
        action="heartbeat_run.status_changed",
        entity_type="heartbeat_run",
        entity_id=run.pk,
        run_id=run.pk,
        details={
            "from": from_status,
            "to": RunStatus.RUNNING,
            **({"slotsTakenFromRunIds": taken_from} if taken_from else {}),
        },
    )


def run_finish_in_tx(
    *,
    run: HeartbeatRun,
    to_status: str,
    actor_type: str,
    actor_id: str,
    details: dict[str, Any] | None = None,
) -> None:
    """Move a locked live run to a terminal status and free its issue's execution slots.

    For composition inside another service's transaction (finalization, recovery): the caller
    has locked the run's issue and then the run (`paperclip.locks.run_lock_with_issue`), and has
    decided the transition is allowed. Sets `finished_at` (database time), clears the issue's
    `execution_run` / `checkout_run` where they point at this run, writes one
    `heartbeat_run.status_changed` audit row (extra `details` are merged in), ends the run's
    controller lease (its coordinator's `lease_expires_at` set to now), refreshes `run`.
    """
    require_transaction()
    if to_status not in HeartbeatRun.TERMINAL_STATUSES:
        raise ValueError(f"{to_status!r} is not a terminal run status")
    from_status = run.status
    row_update_audited(
        run,
        {"status": to_status, "finished_at": Now(), "updated_at": Now()},
        company_id=run.company_id,
        actor_type=actor_type,
        actor_id=actor_id,
        action="heartbeat_run.status_changed",
        entity_type="heartbeat_run",
        entity_id=run.pk,
        run_id=run.pk,
        details={**(details or {}), "from": from_status, "to": to_status},
    )
    # A terminal run has no controller any more: its controller lease ends with it, so no
    # checkpoint or other controller write is accepted after this commit.
    NativeRunFinalization.objects.filter(run_id=run.pk, lease_expires_at__gt=Now()).update(
        lease_expires_at=Now(), updated_at=Now()
    )
    issue_slots_release_in_tx(run_id=run.pk)


def issue_slots_release_in_tx(*, run_id: UUID) -> bool:
    """Clear every issue's `execution_run` / `checkout_run` that points at this run.

    Inside the caller's transaction, with the issue locked (lock order issue -> run). Returns
    whether any slot was cleared. No audit row of its own: callers record the run's change.
    """
    require_transaction()
    executing = Issue.objects.filter(execution_run_id=run_id).update(
        execution_run=None, execution_locked_at=None, updated_at=Now()
    )
    checked_out = Issue.objects.filter(checkout_run_id=run_id).update(
        checkout_run=None, updated_at=Now()
    )
    return bool(executing or checked_out)


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def run_interrupt(
    *,
    company_ids: frozenset[UUID] | None,
    run_id: UUID,
    actor_type: str,
    actor_id: str,
    reason: str,
    still: Callable[[HeartbeatRun], bool] | None = None,
) -> HeartbeatRun | None:
    """Mark a live run `interrupted` at once (the board's "this agent is gone", or the worker's
    orphaned-run sweep), releasing its issue's execution lock; `reason` goes into the audit row.

    `company_ids` limits which runs the actor may see (None: all, the system). `still(run)`,
    when given, re-judges the locked run and may decline (None returned, nothing written): the
    sweep's check that the run is still orphaned. Locks issue -> run. Raises NotFoundError,
    InvalidRunTransition (422: the run is terminal already), ResourceBusy.
    """
    with busy_on_lock_timeout(run_id=str(run_id)), transaction.atomic(durable=True):
        set_local_lock_timeout()
        locked = run_lock_with_issue(run_id=run_id, lock_coordinator=True)
        run = locked.run
        if company_ids is not None and run.company_id not in company_ids:
            raise NotFoundError()  # as a run that does not exist
        if run.is_terminal:
            raise InvalidRunTransition(
                f"A {run.status} run cannot become interrupted.",
                run_id=str(run.pk),
                from_status=run.status,
                to_status=RunStatus.INTERRUPTED,
            )
        if still is not None and not still(run):
            return None
        if _run_has_accepted_result(run, locked.coordinator):
            # Its work is done and saved; interrupting it would strand its finalization (and
            # any board hold waiting on it). It ends through finalization.
            raise InvalidRunTransition(
                "This run's result was accepted; it ends through finalization, not by an "
                "interrupt.",
                remediation=(
                    "Its finalization waits (see the run's finalization state); if it is held "
                    "for the board, decide its hold. A new run on the issue can start meanwhile."
                ),
                run_id=str(run.pk),
                from_status=run.status,
                to_status=RunStatus.INTERRUPTED,
            )
        run_finish_in_tx(
            run=run,
            to_status=RunStatus.INTERRUPTED,
            actor_type=actor_type,
            actor_id=actor_id,
            details={"reason": reason},
        )
    return run
