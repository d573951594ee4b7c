"""Builders of stuck work for the console's tests: one of each kind the dashboard counts."""

from __future__ import annotations

import time
from typing import Any

from django.db import connection, transaction

from checkpoints.models import NativeRunnerCheckpoint
from leases.models import EnvironmentLease
from paperclip.models import (
    Company,
    HeartbeatRun,
    Issue,
    NativeRunFinalization,
    WorkspaceOperation,
)
from recovery.models import IssueRecoveryAction
from recovery.services.export_repair import export_hold_in_tx
from tests.leases.environment.factories import EnvironmentLeaseFactory, export_marker, set_meta
from tests.leases.factories import claim, expire, running_run
from tests.paperclip.factories import (
    AgentFactory,
    ExecutionWorkspaceFactory,
    HeartbeatRunFactory,
    IssueFactory,
)
from tests.recovery.factories import (
    Binding,
    exited_pid,
    hold_for_board,
    make_binding,
    receipt_for,
)


def held(
    company: Company, *, receipt: dict[str, Any] | None = None, phase: str = "workspace_finalizing"
) -> tuple[Binding, IssueRecoveryAction, dict[str, Any]]:
    """A run held for the board: its recorded owner ran on this host and is dead, and no
    copy-back barrier exists (the default), unless `receipt` says otherwise."""
    receipt = receipt if receipt is not None else receipt_for(pid=exited_pid())
    b = make_binding(company=company, receipt=receipt, phase=phase)
    action = hold_for_board(b, receipt)
    return b, action, receipt


def held_export(company: Company) -> tuple[Binding, IssueRecoveryAction]:
    """A run whose export spent its retry budget and is held for the board's repair, as the
    finalizer leaves it (export_hold_in_tx in the transaction of its last failure)."""
    b = make_binding(company=company, phase="retryable_failure")
    NativeRunFinalization.objects.filter(pk=b.run.pk).update(
        failure_code="workspace_copyback_retry_exhausted", attempt=5
    )
    b.refresh()
    with transaction.atomic():
        action = export_hold_in_tx(
            issue=b.issue,
            run=b.run,
            coordinator=b.coordinator,
            failure={
                "code": "copyback_io_error",
                "detail": "No space left on device",
                "attempts": 5,
            },
        )
    return b, action


def held_conflict(company: Company) -> tuple[Binding, IssueRecoveryAction]:
    """A run held for the board over a workspace head conflict, as the finalizer leaves it
    (conflict_hold_in_tx and the coordinator's failure code in one transaction)."""
    b = make_binding(company=company, phase="workspace_finalizing")
    NativeRunFinalization.objects.filter(pk=b.run.pk).update(
        failure_code="workspace_head_conflict",
        failure_detail={"code": "workspace_head_conflict", "detail": "1 conflicting path(s)"},
    )
    action = IssueRecoveryAction.objects.create(
        company=company,
        source_issue=b.issue,
        kind="workspace_validation",
        owner_type="board",
        cause="workspace_head_conflict",
        fingerprint=f"conflict-{b.run.pk}",
        evidence={"runId": str(b.run.pk), "conflictingPaths": ["README.md"]},
        next_action="Resolve the conflict.",
        held_run=b.run,
    )
    b.refresh()
    return b, action


def stale_lease(company: Company, name: str = "ws") -> Any:
    """A runtime lease whose issue was closed after the claim (owner_issue_terminal)."""
    agent = AgentFactory(company=company)
    workspace = ExecutionWorkspaceFactory(company=company, name=name)
    issue = IssueFactory(company=company, status="in_progress")
    lease = claim(workspace, agent, issue_id=issue.pk).lease
    Issue.objects.filter(pk=issue.pk).update(status="done")
    return lease


def expired_lease(company: Company, name: str = "ws-expired") -> Any:
    agent = AgentFactory(company=company)
    workspace = ExecutionWorkspaceFactory(company=company, name=name)
    lease = claim(workspace, agent).lease
    expire(workspace, seconds_ago=3600)
    return lease


def failed_coordinator(company: Company) -> NativeRunFinalization:
    b = make_binding(company=company, phase="retryable_failure")
    NativeRunFinalization.objects.filter(pk=b.run.pk).update(
        failure_code="workspace_copyback_retry_exhausted", attempt=5
    )
    WorkspaceOperation.objects.create(
        company=company,
        heartbeat_run=b.run,
        issue=b.issue,
        execution_workspace=b.workspace,
        phase=WorkspaceOperation.PHASE_WORKSPACE_FINALIZE,
        status=WorkspaceOperation.Status.FAILED,
    )
    return NativeRunFinalization.objects.get(pk=b.run.pk)


def retrying_coordinator(company: Company) -> NativeRunFinalization:
    b = make_binding(company=company, phase="result_accepted")
    NativeRunFinalization.objects.filter(pk=b.run.pk).update(
        failure_code="workspace_copyback_failed", attempt=1
    )
    return NativeRunFinalization.objects.get(pk=b.run.pk)


def invalid_marker_lease(company: Company) -> EnvironmentLease:
    agent = AgentFactory(company=company)
    run = HeartbeatRunFactory(company=company, agent=agent, status=HeartbeatRun.Status.FAILED)
    lease = EnvironmentLeaseFactory(
        company=company, status="pending_cleanup", cleanup_status="pending", heartbeat_run=run
    )
    return set_meta(lease, nativeWorkspaceExportResume=export_marker(lease, leaseId="elsewhere"))


def overdue_claim_lease(company: Company) -> EnvironmentLease:
    lease = EnvironmentLeaseFactory(
        company=company, status="pending_cleanup", cleanup_status="pending"
    )
    expired_ms = int(time.time() * 1000) - 60_000
    return set_meta(
        lease,
        pendingCleanupInFlight=True,
        pendingCleanupAttemptId="attempt-1",
        pendingCleanupLeaseExpiresAtMs=expired_ms,
    )


def failed_cleanup_lease(company: Company) -> EnvironmentLease:
    return EnvironmentLeaseFactory(
        company=company, status="pending_cleanup", cleanup_status="failed"
    )


def checkpoint_part(b: Binding) -> NativeRunnerCheckpoint:
    """A stored checkpoint part of the binding's run (its bytes do not matter to the console)."""
    return NativeRunnerCheckpoint.objects.create(
        company=b.run.company,
        issue=b.issue,
        run=b.run,
        part="session.jsonl",
        scheme="aes-256-gcm",
        key_id="k1",
        nonce=b"",
        ciphertext=b"",
        size_bytes=2048,
    )


def expired_authority(company: Company) -> NativeRunFinalization:
    """A running run whose controller lease lapsed while it holds a checkpoint part."""
    b = make_binding(company=company, phase="observed", with_result=False)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE native_run_finalizations SET lease_expires_at = now() - interval '1 hour',"
            " lease_owner = 'gone' WHERE run_id = %s",
            [b.run.pk],
        )
    checkpoint_part(b)
    return NativeRunFinalization.objects.get(pk=b.run.pk)


def one_of_each(company: Company, tag: str = "") -> dict[str, Any]:
    return {
        "authority": expired_authority(company),
        "held": held(company),
        "stale": stale_lease(company, f"ws-stale{tag}"),
        "expired": expired_lease(company, f"ws-expired{tag}"),
        "failed": failed_coordinator(company),
        "retrying": retrying_coordinator(company),
        "marker": invalid_marker_lease(company),
        "overdue": overdue_claim_lease(company),
        "cleanup_failed": failed_cleanup_lease(company),
    }


def db_now_ms() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT (extract(epoch from now()) * 1000)::bigint")
        return int(cursor.fetchone()[0])


def orphaned_run(*, seconds: int = 120, company: Company | None = None) -> HeartbeatRun:
    """A running native run (of `company`, default a fresh one) whose runtime lease lapsed
    `seconds` ago and that started before that: orphaned, its issue still locked by it."""
    run, _claim = running_run(company=company)
    expire(run.execution_workspace, seconds_ago=seconds)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE heartbeat_runs SET started_at = now() - make_interval(secs => %s)"
            " WHERE id = %s",
            [seconds + 60, run.pk],
        )
    run.refresh_from_db()
    return run
