"""Workspace export repair: an export that spends its retry budget is held for the board, the
board's "Retry workspace export" is admitted only while everything the hold recorded is
current (and the sandbox's stop is confirmed), a repeat writes nothing, a failed retry asks
for the next repair, and the commit resolves the hold. Failures are real: the workspace cwd's
parent is a regular file until the "repair" removes it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from django.test import override_settings
from django.utils import timezone
from procrastinate.contrib.django.models import ProcrastinateJob

from leases.models import EnvironmentLease, WorkspaceRuntimeLease
from paperclip.models import ActivityEvent, HeartbeatRun, NativeRunFinalization
from recovery.locks import finalization_lock_key
from recovery.models import IssueRecoveryAction
from recovery.services import Acquired, run_finalize
from recovery.services.export_repair import EXPORT_REPAIR_CAUSE
from tests.helpers import assert_error, raw_connection, run_jobs
from tests.leases.environment.factories import (
    EnvironmentLeaseFactory,
    ProviderAgentFactory,
    sync_reference,
)
from tests.paperclip.factories import AgentFactory, NativeRunFactory
from tests.recovery.factories import Binding, make_binding

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("one_attempt"),
]

NOTE = "freed 40 GiB on the worker's volume and fixed the cwd's parent"


@pytest.fixture
def one_attempt() -> Any:
    with override_settings(PAPERCLIP_FINALIZE_MAX_ATTEMPTS=1):
        yield


def _blocked(tmp_path: Path, **kwargs: Any) -> Binding:
    """A run whose export fails for real: the cwd's parent directory is a regular file."""
    b = make_binding(tmp_path=tmp_path, **kwargs)
    assert b.dest_dir is not None
    b.dest_dir.parent.write_text("not a directory\n")
    return b


def _repair(b: Binding) -> None:
    assert b.dest_dir is not None
    b.dest_dir.parent.unlink()


def _exhaust(b: Binding) -> IssueRecoveryAction:
    outcome = run_finalize(company_id=b.company.pk, run_id=b.run.pk)
    assert isinstance(outcome, Acquired)
    assert outcome.value.status == "retry_exhausted"
    return IssueRecoveryAction.objects.get(source_issue=b.issue, cause=EXPORT_REPAIR_CAUSE)


def _url(b: Binding) -> str:
    return f"/api/issues/{b.issue.pk}/recovery-actions/retry-workspace-export"


def _body(b: Binding, hold: IssueRecoveryAction, note: str = NOTE) -> dict[str, Any]:
    return {"action_id": str(hold.pk), "run_id": str(b.run.pk), "repair_note": note}


def _unchanged(hold: IssueRecoveryAction) -> tuple[Any, ...]:
    hold.refresh_from_db()
    return (hold.status, hold.evidence, hold.next_action, ActivityEvent.objects.count())


def test_an_exhausted_export_is_held_retried_by_the_board_and_committed(
    tmp_path: Path, make_board_client: Any, make_agent_client: Any
) -> None:
    b = _blocked(tmp_path)
    hold = _exhaust(b)

    assert (hold.status, hold.owner_type, hold.kind) == ("active", "board", "workspace_validation")
    evidence = hold.evidence
    assert evidence["runId"] == str(b.run.pk)
    assert evidence["resultId"] == str(b.result.pk)
    assert evidence["descriptor"] == {
        "kind": "directory",
        "source": str(b.source_dir),
        "destination": str(b.dest_dir),
    }
    assert evidence["leaseId"] is None
    assert evidence["failure"]["code"] == "copyback_io_error"
    assert evidence["failure"]["attempts"] == 1
    state = make_agent_client(b.agent).get(f"/api/heartbeat-runs/{b.run.pk}").json()
    assert state["finalization"]["state"] == "failed"  # the contract's state is unchanged

    # Retried before the cause is repaired: admitted (the board says it repaired), it fails
    # again, and the hold asks for the next repair with the earlier request in its history.
    board = make_board_client(b.company)
    first = board.post(_url(b), _body(b, hold, "retrying once to see the error again"), "json")
    assert first.status_code == 202, first.json()
    before = _unchanged(hold)
    repeat = board.post(_url(b), _body(b, hold, "a different note, same request"), "json")
    assert repeat.json() == first.json()
    assert _unchanged(hold) == before  # an idempotent repeat writes nothing
    assert hold.evidence["workspaceExportRetry"]["repairNote"] == (
        "retrying once to see the error again"
    )
    run_jobs()
    hold.refresh_from_db()
    assert hold.status == "active"
    assert "workspaceExportRetry" not in hold.evidence
    [earlier] = hold.evidence["retries"]
    assert earlier["repairNote"] == "retrying once to see the error again"
    assert earlier["failure"]["code"] == "copyback_io_error"

    _repair(b)
    audit = ActivityEvent.objects.count()
    queued = board.post(_url(b), _body(b, hold), "json")
    assert queued.status_code == 202, queued.json()
    assert queued.json() == {
        "run_id": str(b.run.pk),
        "result_id": str(b.result.pk),
        "lease_id": None,
        "status": "queued",
    }
    assert ActivityEvent.objects.count() == audit + 1
    rows = ActivityEvent.objects.filter(action="issue.workspace_export_retry_requested")
    assert [row.details["repairNote"] for row in rows.order_by("created_at")][-1] == NOTE
    state = make_agent_client(b.agent).get(f"/api/heartbeat-runs/{b.run.pk}").json()
    assert state["finalization"]["state"] == "queued"

    run_jobs()
    b.refresh()
    assert b.coordinator.phase == "committed"
    assert b.run.status == "succeeded"
    assert b.dest_dir is not None
    assert (b.dest_dir / "README.md").read_text() == "hello\n"
    hold.refresh_from_db()
    assert (hold.status, hold.outcome) == ("resolved", "restored")
    # After the commit a repeat answers the same and writes nothing.
    audit = ActivityEvent.objects.count()
    again = board.post(_url(b), _body(b, hold), "json")
    assert again.status_code == 202
    assert again.json() == queued.json()
    assert ActivityEvent.objects.count() == audit


def test_bad_requests_are_refused_and_change_nothing(
    tmp_path: Path, make_board_client: Any, make_agent_client: Any
) -> None:
    b = _blocked(tmp_path)
    hold = _exhaust(b)
    board, agent, stranger = (
        make_board_client(b.company),
        make_agent_client(b.agent),
        make_board_client(),
    )
    before = _unchanged(hold)

    assert_error(board.post(_url(b), _body(b, hold, "fixed   it"), "json"), 400, "invalid_request")
    assert_error(board.post(_url(b), {**_body(b, hold), "x": 1}, "json"), 400, "invalid_request")
    assert_error(agent.post(_url(b), _body(b, hold), "json"), 403, "permission_denied")
    assert_error(stranger.post(_url(b), _body(b, hold), "json"), 404, "not_found")
    other = NativeRunFactory(company=b.company, agent=b.agent, issue=b.issue)
    stale = board.post(_url(b), {**_body(b, hold), "run_id": str(other.pk)}, "json")
    assert_error(stale, 409, "workspace_export_retry_stale")
    other.delete()
    # An attempt in progress holds the run's finalization lock.
    with raw_connection() as holder:
        holder.execute(
            "SELECT pg_advisory_lock(hashtextextended(%s, 0))",
            [finalization_lock_key(b.company.pk, b.run.pk)],
        )
        busy = board.post(_url(b), _body(b, hold), "json")
        assert_error(busy, 409, "workspace_copyback_active")
    assert _unchanged(hold) == before


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ("reassigned", "issue_moved_on"),
        ("cwd_moved", "descriptor_changed"),
        ("competing_lease", "competing_lease"),
        ("hold_resolved", "action_not_current"),
    ],
)
def test_a_changed_binding_is_refused_as_stale(
    tmp_path: Path, make_board_client: Any, change: str, reason: str
) -> None:
    b = _blocked(tmp_path)
    hold = _exhaust(b)
    if change == "reassigned":
        b.issue.assignee_agent = AgentFactory(company=b.company)
        b.issue.save(update_fields=["assignee_agent"])
    elif change == "cwd_moved":
        b.workspace.cwd = str(tmp_path / "elsewhere")
        b.workspace.save(update_fields=["cwd"])
    elif change == "competing_lease":
        WorkspaceRuntimeLease.objects.create(
            company=b.company,
            execution_workspace=b.workspace,
            owner_key="agent:someone-else",
            last_action="start",
            expires_at=timezone.now() + timezone.timedelta(minutes=5),
        )
    else:
        IssueRecoveryAction.objects.filter(pk=hold.pk).update(status="resolved")
    board = make_board_client(b.company)
    before = _unchanged(hold)

    refused = board.post(_url(b), _body(b, hold), "json")

    error = assert_error(refused, 409, "workspace_export_retry_stale")
    assert error["details"]["reason"] == reason
    assert _unchanged(hold) == before
    assert NativeRunFinalization.objects.get(pk=b.run.pk).phase == "retryable_failure"


def test_a_sandbox_is_kept_stopped_and_its_stop_confirmed_before_the_retry(
    tmp_path: Path, make_board_client: Any, make_agent_client: Any
) -> None:
    b = _blocked(tmp_path)
    lease = EnvironmentLeaseFactory(
        company=b.company,
        heartbeat_run=b.run,
        execution_workspace=b.workspace,
        issue=b.issue,
    )
    HeartbeatRun.objects.filter(pk=b.run.pk).update(
        runner_profile_json={
            **b.run.runner_profile_json,
            "nativeWorkspaceSync": sync_reference(lease, b.workspace.pk),
        }
    )
    hold = _exhaust(b)

    # The hold tagged the sandbox stop-only: stopped and kept, never destroyed.
    lease.refresh_from_db()
    assert lease.status == "pending_cleanup"
    assert lease.failure_reason == "workspace_export_stop_pending"
    assert hold.evidence["leaseId"] == str(lease.pk)
    assert hold.evidence["providerLeaseId"] == lease.provider_lease_id
    assert hold.evidence["stopOnlyRequestId"]
    _repair(b)
    board = make_board_client(b.company)
    before = _unchanged(hold)
    unconfirmed = board.post(_url(b), _body(b, hold), "json")
    error = assert_error(unconfirmed, 409, "workspace_export_stop_unconfirmed")
    assert error["details"]["lease_id"] == str(lease.pk)
    assert _unchanged(hold) == before

    # The provider stops it through the cleanup protocol, over HTTP.
    client = make_agent_client(ProviderAgentFactory(company=b.company))
    claim = client.post(f"/api/environment-leases/{lease.pk}/cleanup-claims")
    assert claim.status_code == 200, claim.json()
    settled = client.post(
        f"/api/environment-leases/{lease.pk}/cleanup-receipts",
        {
            "attempt_id": claim.json()["attempt_id"],
            "receipt": {"provider_lease_id": lease.provider_lease_id, "state": "stopped"},
        },
        format="json",
    )
    assert settled.status_code == 200, settled.json()
    lease.refresh_from_db()
    assert lease.status in EnvironmentLease.RETIRED_STATUSES

    queued = board.post(_url(b), _body(b, hold), "json")
    assert queued.status_code == 202, queued.json()
    assert queued.json()["lease_id"] == str(lease.pk)
    run_jobs()
    assert NativeRunFinalization.objects.get(pk=b.run.pk).phase == "committed"


@override_settings(PAPERCLIP_FINALIZE_MAX_ATTEMPTS=2)
def test_the_boards_retry_is_attempted_even_behind_a_waiting_follow_up(
    tmp_path: Path, make_board_client: Any
) -> None:
    """A failed attempt leaves an owner's follow-up job waiting at its retry time; an explicit
    attempt (`manage.py finalize_run`) then spends the budget and the export is held. The
    board's "Retry workspace export" rode on that waiting job (one per run), which, run as an
    automatic attempt, found the spent budget not due and did nothing: recorded as queued,
    never attempted, and a repeat was a replay. Its own explicit job now replaces the
    follow-up and commits the repaired export."""
    b = make_binding(tmp_path=tmp_path)
    assert b.dest_dir is not None
    b.dest_dir.parent.write_text("not a directory\n")  # the export fails for real
    first = run_finalize(company_id=b.company.pk, run_id=b.run.pk)
    assert isinstance(first, Acquired)
    assert first.value.status == "retry_scheduled"
    lock = f"finalize-run:{b.run.pk}"
    waiting = ProcrastinateJob.objects.get(queueing_lock=lock, status="todo")
    assert waiting.args["explicit"] is False  # the owner's follow-up, at the retry time
    second = run_finalize(company_id=b.company.pk, run_id=b.run.pk)
    assert isinstance(second, Acquired)
    assert second.value.status == "retry_exhausted"
    hold = IssueRecoveryAction.objects.get(source_issue=b.issue, cause=EXPORT_REPAIR_CAUSE)
    b.dest_dir.parent.unlink()  # repaired
    board = make_board_client(b.company)
    answer = board.post(
        f"/api/issues/{b.issue.pk}/recovery-actions/retry-workspace-export",
        {"action_id": str(hold.pk), "run_id": str(b.run.pk), "repair_note": NOTE},
        format="json",
    )
    assert answer.status_code == 202, answer.json()
    todo = ProcrastinateJob.objects.get(queueing_lock=lock, status="todo")
    assert todo.args["explicit"] is True
    assert ProcrastinateJob.objects.get(pk=waiting.pk).status == "cancelled"
    audit = ActivityEvent.objects.get(action="issue.workspace_export_retry_requested")
    assert audit.details["finalizationJobId"] == todo.pk
    run_jobs()
    assert NativeRunFinalization.objects.get(run_id=b.run.pk).phase == "committed"
