"""Is the task a platform-proof takeover resumed still the current one
(docs/recovery.md#assert-held): the stop receipt proves the old worker exited, not that its
task still waits."""

from __future__ import annotations

from collections.abc import Callable
from uuid import UUID

from django.db import transaction

from paperclip.models import HeartbeatRun, Issue, NativeRunFinalization, NativeRunResult
from recovery.locks import (
    coordinators_for_update,
    issues_for_update,
    recovery_actions_for_update,
    runs_for_update,
)
from recovery.models import IssueRecoveryAction
from recovery.selectors.actions import WAITING_PHASES, run_issue_id


def current_recovery_result_id(
    *, company_id: UUID, run_id: UUID, lock: bool, committed_ok: bool = False
) -> UUID | None:
    """The accepted result still waiting for this run's finalization, or None when the task
    moved on. With `lock`, rows are locked in the global order (issue → coordinator → run).
    `committed_ok`: a coordinator that committed this very result still counts (the owner's
    own action commits it before the final `assert_held`)."""
    run = HeartbeatRun.objects.filter(pk=run_id, company_id=company_id).first()
    issue_id = run_issue_id(run) if run is not None else None
    if run is None or issue_id is None:
        return None
    issues = issues_for_update() if lock else Issue.objects.all()
    coordinators = coordinators_for_update() if lock else NativeRunFinalization.objects.all()
    runs = runs_for_update() if lock else HeartbeatRun.objects.all()
    issue = issues.filter(pk=issue_id, company_id=company_id).first()
    coordinator = coordinators.filter(run_id=run_id, company_id=company_id).first()
    current_run = runs.filter(pk=run_id, company_id=company_id).first()
    if issue is None or coordinator is None or current_run is None:
        return None
    if coordinator.issue_id != issue.pk or coordinator.result_id is None:
        return None
    phases: tuple[str, ...] = (*WAITING_PHASES, "retryable_failure")
    if committed_ok:
        phases += (NativeRunFinalization.Phase.COMMITTED,)
    if coordinator.phase not in phases:
        return None
    # Another run holding the issue now does not replace this one's saved result: a later run
    # takes the slots of a run whose result was accepted, whose finalization still waits.
    accepted = NativeRunResult.objects.filter(
        pk=coordinator.result_id,
        company_id=company_id,
        issue_id=issue.pk,
        run_id=run_id,
        schema_status=NativeRunResult.SchemaStatus.ACCEPTED,
    ).exists()
    return coordinator.result_id if accepted else None


def retained_repair_current(
    *, company_id: UUID, run_id: UUID, issue_id: UUID, action_id: UUID, lock: bool = True
) -> bool:
    """Retained repair (docs/recovery.md#retained-repair): the repair action still names this
    terminal run, no controller lease is live, and no other run holds the issue (except the
    independent continuation run recorded on the action). With `lock`, rows are locked in the global
    order (issue → coordinator → run → action)."""
    issues = issues_for_update() if lock else Issue.objects.all()
    coordinators = coordinators_for_update() if lock else NativeRunFinalization.objects.all()
    runs = runs_for_update() if lock else HeartbeatRun.objects.all()
    actions = recovery_actions_for_update() if lock else IssueRecoveryAction.objects.all()
    issue = issues.filter(pk=issue_id, company_id=company_id).first()
    coordinator = coordinators.filter(run_id=run_id, company_id=company_id).first()
    run = runs.filter(pk=run_id, company_id=company_id).first()
    repair = actions.filter(pk=action_id, company_id=company_id, source_issue_id=issue_id).first()
    if issue is None or run is None or repair is None:
        return False
    evidence = repair.evidence if isinstance(repair.evidence, dict) else {}
    continuation = evidence.get("explicitUserContinuation")
    independent: str | None = None
    if isinstance(continuation, dict):
        readiness = continuation.get("readiness")
        if (
            isinstance(readiness, dict)
            and readiness.get("mode") == "fresh_isolated_workspace"
            and readiness.get("sourceRunId") == str(run_id)
            and isinstance(continuation.get("runId"), str)
        ):
            independent = continuation["runId"]
    allowed_holders = {None, independent}
    return (
        evidence.get("runId") == str(run.pk)
        and bool(evidence.get("workspaceRecovery"))
        and (coordinator is None or not coordinator.lease_owner)
        and run.status in HeartbeatRun.TERMINAL_STATUSES
        and (str(issue.execution_run_id) if issue.execution_run_id else None) in allowed_holders
        and (str(issue.checkout_run_id) if issue.checkout_run_id else None) in allowed_holders
    )


def binding_recheck(
    *,
    company_id: UUID,
    run_id: UUID,
    issue_id: UUID | None,
    proof_used: bool,
    retained_repair_action_id: UUID | None,
    automatic_result_id: UUID | None,
    using: str,
) -> Callable[[], bool] | None:
    """What `assert_held` rechecks after a platform-proof takeover (docs/recovery.md#assert-held):
    the stop receipt proved the old worker exited, not that its task is still current."""
    if not proof_used:
        return None
    if retained_repair_action_id is not None and issue_id is not None:
        repair_id = retained_repair_action_id

        def repair_current() -> bool:
            with transaction.atomic(using=using):
                return retained_repair_current(
                    company_id=company_id,
                    run_id=run_id,
                    issue_id=issue_id,
                    action_id=repair_id,
                    lock=False,
                )

        return repair_current

    def result_current() -> bool:
        with transaction.atomic(using=using):
            current = current_recovery_result_id(
                company_id=company_id, run_id=run_id, lock=False, committed_ok=True
            )
        return current is not None and current == automatic_result_id

    return result_current
