"""One hold per held run (docs/recovery.md#one-hold-per-held-run): a board hold names its run
and is that run's alone; a later run, a later hold on the same issue or the issue's single-action
rule never cancels it, and resolving one run's hold leaves the others live."""

from __future__ import annotations

import dataclasses
import importlib
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.db import connection, transaction
from django.utils import timezone
from procrastinate.contrib.django.models import ProcrastinateJob
from rest_framework.test import APIClient

from leases.models import WorkspaceRuntimeLease
from leases.orphans import orphaned_runs, orphaned_runs_interrupt
from paperclip.models import ActivityEvent, ExecutionWorkspace, NativeRunFinalization
from paperclip.snapshots.head import PublishPlan
from recovery.models import IssueRecoveryAction
from recovery.selectors.actions import OWNER_UNVERIFIED_CAUSE
from recovery.selectors.finalization import finalization_state
from recovery.selectors.holds import HOLD_REMEDIATION
from recovery.services import (
    Acquired,
    NotAcquired,
    RecoveryActionInput,
    recovery_action_upsert_source_scoped,
    run_finalize,
    with_finalization_ownership,
)
from recovery.services.conflicts import conflict_hold_in_tx
from tests.helpers import run_jobs
from tests.paperclip.factories import NativeRunFactory
from tests.paperclip.helpers import audit_count
from tests.recovery.factories import Binding, make_binding, next_run, receipt_for
from tests.recovery.snapshots import Files, snapshot_result, store_tree

pytestmark = pytest.mark.django_db(transaction=True)

CONFLICT = "workspace_head_conflict"
BASE: Files = {"README.md": b"hello\n", "src/main.py": b"print('hi')\n"}


def _conflicting(b: Binding, content: bytes) -> None:
    """`b`'s result names a snapshot that changes README.md from BASE, which the head changed
    too."""
    base = store_tree(b.company.pk, BASE)
    ours = store_tree(b.company.pk, {**BASE, "README.md": content})
    assert b.result is not None
    snapshot_result(b.run, b.result, ours, base)


def _held(tmp_path: Path) -> tuple[Binding, Binding, str]:
    """Two runs of one agent on one issue, each held for a conflict with the head."""
    first = make_binding()
    theirs = store_tree(first.company.pk, {**BASE, "README.md": b"theirs\n"})
    first.workspace.cwd = str(tmp_path / "cwd")
    first.workspace.head_tree = theirs
    first.workspace.save(update_fields=["cwd", "head_tree"])
    _conflicting(first, b"first\n")
    assert _finalize(first).status == "held"
    second = next_run(first)
    _conflicting(second, b"second\n")
    assert _finalize(second).status == "held"
    return first, second, theirs


def _finalize(b: Binding) -> Any:
    outcome = run_finalize(company_id=b.company.pk, run_id=b.run.pk)
    assert isinstance(outcome, Acquired), outcome
    return outcome.value


def _hold(b: Binding, cause: str = CONFLICT) -> IssueRecoveryAction:
    return IssueRecoveryAction.objects.get(held_run=b.run, cause=cause)


def test_two_runs_of_an_issue_each_keep_their_own_conflict_hold(tmp_path: Path) -> None:
    first, second, _theirs = _held(tmp_path)
    holds = IssueRecoveryAction.objects.filter(source_issue=first.issue).order_by("created_at")
    assert [(h.status, h.evidence["runId"]) for h in holds] == [
        ("active", str(first.run.pk)),
        ("active", str(second.run.pk)),
    ]
    assert audit_count("recovery_action.superseded") == 0
    for b in (first, second):
        b.run.refresh_from_db()
        assert b.run.status == "running"
        state = finalization_state(b.run)
        assert (state.state, state.reason) == ("held", CONFLICT)


def test_each_run_s_hold_is_resolved_on_its_own(tmp_path: Path, make_board_client: Any) -> None:
    first, second, theirs = _held(tmp_path)
    board: APIClient = make_board_client(first.company)
    url = f"/api/issues/{first.issue.pk}/recovery-actions/resolve-workspace-conflict"
    response = board.post(
        url,
        {
            "action_id": str(_hold(first).pk),
            "run_id": str(first.run.pk),
            "resolution": "discard",
            "note": "the second run's README is the one we keep",
        },
        format="json",
    )
    assert response.status_code == 202, response.content
    run_jobs()
    assert NativeRunFinalization.objects.get(pk=first.run.pk).phase == "committed"
    assert _hold(first).status == "resolved"
    # The second run still waits for the board, with its own hold.
    assert _hold(second).status == "active"
    second.run.refresh_from_db()
    assert second.run.status == "running"
    assert finalization_state(second.run).state == "held"
    assert ExecutionWorkspace.objects.get(pk=first.workspace.pk).head_tree == theirs


def test_a_second_conflict_of_the_same_run_updates_its_own_hold() -> None:
    b = make_binding()

    def plan(head: str) -> PublishPlan:
        return PublishPlan(
            kind="conflict",
            workspace_id=b.workspace.pk,
            tree="sha256:" + "1" * 64,
            base=None,
            expected_head=head,
            new_head=None,
            conflicts=("README.md",),
            conflict_count=1,
        )

    args = {"company_id": b.company.pk, "issue_id": b.issue.pk, "run_id": b.run.pk}
    with transaction.atomic():
        held = conflict_hold_in_tx(**args, agent_id=b.agent.pk, plan=plan("sha256:" + "a" * 64))
    with transaction.atomic():
        again = conflict_hold_in_tx(**args, agent_id=b.agent.pk, plan=plan("sha256:" + "b" * 64))
    assert again.pk == held.pk
    assert again.evidence["head"] == "sha256:" + "b" * 64
    assert IssueRecoveryAction.objects.filter(source_issue=b.issue).count() == 1
    assert (audit_count("recovery_action.created"), audit_count("recovery_action.updated")) == (
        1,
        1,
    )


def test_a_later_owner_unverified_hold_does_not_cancel_an_earlier_conflict_hold(
    tmp_path: Path,
) -> None:
    first = make_binding()
    first.workspace.head_tree = store_tree(first.company.pk, {**BASE, "README.md": b"theirs\n"})
    first.workspace.save(update_fields=["head_tree"])
    _conflicting(first, b"first\n")
    assert _finalize(first).status == "held"
    later = next_run(first, receipt=receipt_for(hostname="elsewhere.example"))
    outcome = with_finalization_ownership(
        company_id=later.company.pk, run_id=later.run.pk, action=lambda o: 1
    )
    assert outcome == NotAcquired("owner_unverified")
    assert _hold(first).status == "active"
    assert _hold(later, OWNER_UNVERIFIED_CAUSE).status == "active"
    assert audit_count("recovery_action.superseded") == 0


def test_the_issue_s_own_action_neither_cancels_nor_is_cancelled_by_a_run_s_hold() -> None:
    """The single-live-action rule stays for actions that hold no run."""
    b = make_binding()
    hold = recovery_action_upsert_source_scoped(
        company_id=b.company.pk,
        source_issue_id=b.issue.pk,
        data=RecoveryActionInput(
            kind="workspace_validation",
            cause=CONFLICT,
            fingerprint="conflict-1",
            evidence={"runId": str(b.run.pk)},
            next_action="decide",
            owner_type="board",
            held_run_id=b.run.pk,
        ),
    ).action
    generic = RecoveryActionInput(
        kind="stranded_assigned_issue",
        cause="stranded",
        fingerprint="s1",
        evidence={},
        next_action="look",
        supersede_on_identity_change=True,
    )
    args: dict[str, Any] = {"company_id": b.company.pk, "source_issue_id": b.issue.pk}
    assert recovery_action_upsert_source_scoped(**args, data=generic).outcome == "created"
    other = dataclasses.replace(generic, fingerprint="s2")
    assert recovery_action_upsert_source_scoped(**args, data=other).outcome == "superseded"
    hold.refresh_from_db()
    assert hold.status == "active"
    live = IssueRecoveryAction.objects.filter(source_issue=b.issue, status="active")
    assert sorted(a.cause for a in live) == ["stranded", CONFLICT]


def test_the_migration_names_the_held_run_of_existing_board_holds() -> None:
    b = make_binding()
    hold = IssueRecoveryAction.objects.create(
        company=b.company,
        source_issue=b.issue,
        kind="workspace_validation",
        owner_type="board",
        cause=CONFLICT,
        fingerprint="f",
        evidence={"runId": str(b.run.pk)},
        next_action="decide",
    )
    agent_owned = IssueRecoveryAction.objects.create(
        company=b.company,
        source_issue=b.issue,
        kind="stranded_assigned_issue",
        owner_type="agent",
        status="resolved",
        cause="stranded",
        fingerprint="s",
        evidence={"runId": str(b.run.pk)},
        next_action="look",
    )
    migration = importlib.import_module("recovery.migrations.0004_held_run")
    with connection.cursor() as cursor:
        cursor.execute(migration.FILL_HELD_RUN)
    hold.refresh_from_db()
    agent_owned.refresh_from_db()
    assert (hold.held_run_id, agent_owned.held_run_id) == (b.run.pk, None)


# --- a later run never interrupts a run whose result was accepted ---------------------------


def _queued_next_run(b: Binding) -> Any:
    return NativeRunFactory(
        company=b.company,
        agent=b.agent,
        issue=b.issue,
        native_issue=b.issue,
        execution_workspace=b.workspace,
        status="queued",
    )


def test_the_agent_s_next_run_starts_and_the_held_run_keeps_waiting_for_the_board(
    tmp_path: Path, make_agent_client: Any, make_board_client: Any
) -> None:
    first = make_binding()
    first.workspace.head_tree = store_tree(first.company.pk, {**BASE, "README.md": b"theirs\n"})
    first.workspace.save(update_fields=["head_tree"])
    _conflicting(first, b"first\n")
    assert _finalize(first).status == "held"
    agent: APIClient = make_agent_client(first.agent)
    following = _queued_next_run(first)
    started = agent.patch(
        f"/api/heartbeat-runs/{following.pk}", {"status": "running"}, format="json"
    )
    assert started.status_code == 200, started.content
    first.issue.refresh_from_db()
    assert (first.issue.execution_run_id, first.issue.checkout_run_id) == (
        following.pk,
        following.pk,
    )
    first.run.refresh_from_db()
    assert first.run.status == "running"  # not interrupted
    assert finalization_state(first.run).state == "held"
    assert _hold(first).status == "active"
    start = ActivityEvent.objects.get(
        action="heartbeat_run.status_changed", entity_id=str(following.pk)
    )
    assert start.details["slotsTakenFromRunIds"] == [str(first.run.pk)]
    # The board still decides the held run; its commit leaves the new run's slots alone.
    board: APIClient = make_board_client(first.company)
    url = f"/api/issues/{first.issue.pk}/recovery-actions/resolve-workspace-conflict"
    body = {
        "action_id": str(_hold(first).pk),
        "run_id": str(first.run.pk),
        "resolution": "discard",
        "note": "superseded by the next run's work",
    }
    assert board.post(url, body, format="json").status_code == 202
    run_jobs()
    first.run.refresh_from_db()
    first.issue.refresh_from_db()
    assert first.run.status == "succeeded"
    assert first.issue.execution_run_id == following.pk


def test_no_status_update_ends_a_run_whose_result_was_accepted(make_agent_client: Any) -> None:
    b = make_binding()
    agent: APIClient = make_agent_client(b.agent)
    writes = ActivityEvent.objects.count()
    for status in ("interrupted", "failed", "cancelled"):
        refused = agent.patch(f"/api/heartbeat-runs/{b.run.pk}", {"status": status}, format="json")
        assert refused.status_code == 422, refused.content
        assert refused.json()["error"]["code"] == "invalid_run_transition"
    b.run.refresh_from_db()
    b.issue.refresh_from_db()
    assert (b.run.status, b.issue.execution_run_id) == ("running", b.run.pk)
    assert ActivityEvent.objects.count() == writes


def test_the_board_s_interrupt_refuses_a_run_whose_result_was_accepted(
    make_board_client: Any,
) -> None:
    b = make_binding(receipt=receipt_for(hostname="elsewhere.example"))
    with_finalization_ownership(company_id=b.company.pk, run_id=b.run.pk, action=lambda o: 1)
    board: APIClient = make_board_client(b.company)
    writes = ActivityEvent.objects.count()
    refused = board.post(
        f"/api/heartbeat-runs/{b.run.pk}/interrupt", {"reason": "looks stuck"}, format="json"
    )
    assert refused.status_code == 422, refused.content
    assert refused.json()["error"]["code"] == "invalid_run_transition"
    b.run.refresh_from_db()
    assert (b.run.status, finalization_state(b.run).state) == ("running", "held")
    assert ActivityEvent.objects.count() == writes


def test_the_orphan_sweep_leaves_a_held_run_alone() -> None:
    """Every lease of the held run lapsed long ago: its agent is gone, but its work is done and
    waits for the board, so it is not orphaned and the sweep does not interrupt it."""
    b = make_binding(receipt=receipt_for(hostname="elsewhere.example"))
    assert with_finalization_ownership(
        company_id=b.company.pk, run_id=b.run.pk, action=lambda o: 1
    ) == NotAcquired("owner_unverified")
    NativeRunFinalization.objects.filter(pk=b.run.pk).update(
        lease_expires_at=timezone.now() - timedelta(days=1)
    )
    WorkspaceRuntimeLease.objects.create(
        company=b.company,
        execution_workspace=b.workspace,
        owner_key=f"issue:{b.issue.pk}",
        owner_issue=b.issue,
        last_action="start",
        expires_at=timezone.now() - timedelta(days=1),
    )
    assert orphaned_runs(run_ids=[b.run.pk]) == []
    swept = orphaned_runs_interrupt(grace_seconds=0)
    assert swept.interrupted == 0
    b.run.refresh_from_db()
    assert b.run.status == "running"
    assert finalization_state(b.run).state == "held"


# --- finalize answers a held run with its reason --------------------------------------------


@pytest.mark.parametrize("wait", ["", "?wait=1"], ids=["no_wait", "wait"])
@pytest.mark.parametrize("reason", ["workspace_head_conflict", "owner_unverified"])
def test_finalize_answers_a_held_run_409_with_its_reason_and_remedy(
    make_agent_client: Any, wait: str, reason: str
) -> None:
    if reason == "workspace_head_conflict":
        b = make_binding()
        b.workspace.head_tree = store_tree(b.company.pk, {**BASE, "README.md": b"theirs\n"})
        b.workspace.save(update_fields=["head_tree"])
        _conflicting(b, b"first\n")
        assert _finalize(b).status == "held"
    else:
        b = make_binding(receipt=receipt_for(hostname="elsewhere.example"))
        assert with_finalization_ownership(
            company_id=b.company.pk, run_id=b.run.pk, action=lambda o: 1
        ) == NotAcquired("owner_unverified")
    agent: APIClient = make_agent_client(b.agent)
    writes, jobs = ActivityEvent.objects.count(), ProcrastinateJob.objects.count()
    response = agent.post(f"/api/heartbeat-runs/{b.run.pk}/finalize{wait}")
    assert response.status_code == 409, response.content
    error = response.json()["error"]
    assert error["code"] == "finalization_not_acquired"
    assert error["details"]["reason"] == reason
    assert error["remediation"] == HOLD_REMEDIATION[reason]
    assert (ActivityEvent.objects.count(), ProcrastinateJob.objects.count()) == (writes, jobs)
