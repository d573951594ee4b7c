"""Owner-stop confirmation admission (docs/recovery.md#owner-stop-admission-checks): every check
refuses on its own and a refusal changes nothing; replays answer the same without writing."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pytest
from django.db import connection
from psycopg import sql

import paperclip.db.locking
from paperclip.models import (
    ActivityEvent,
    HeartbeatRun,
    Issue,
    NativeRunFinalization,
    NativeRunResult,
)
from paperclip.receipts import OWNER_KEY
from recovery.errors import WorkspaceCopybackActive, WorkspaceOwnerRecoveryStale
from recovery.locks import finalization_lock_key
from recovery.models import IssueRecoveryAction
from recovery.services.owner_stop import OwnerStopConfirmation
from tests.helpers import LOCK_WAIT_TIMEOUT, raw_connection, wait_for_lock_waiters
from tests.paperclip.factories import (
    AgentFactory,
    CompanyFactory,
    HeartbeatRunFactory,
    IssueFactory,
    NativeRunFactory,
    NativeRunFinalizationFactory,
    NativeRunResultFactory,
)
from tests.recovery.factories import Binding, RecoveryActionFactory
from tests.recovery.services.test_owner_stop import assert_stale, confirm, held_binding

pytestmark = pytest.mark.django_db

Mutation = Callable[[Binding, IssueRecoveryAction, dict[str, Any]], None]


def _action(**fields: Any) -> Mutation:
    def mutate(b: Binding, action: IssueRecoveryAction, receipt: dict[str, Any]) -> None:
        IssueRecoveryAction.objects.filter(pk=action.pk).update(**fields)

    return mutate


def _evidence_run_id(b: Binding, action: IssueRecoveryAction, receipt: dict[str, Any]) -> None:
    IssueRecoveryAction.objects.filter(pk=action.pk).update(
        evidence={**action.evidence, "runId": "00000000-0000-0000-0000-000000000001"}
    )


def _run(**fields: Any) -> Mutation:
    def mutate(b: Binding, action: IssueRecoveryAction, receipt: dict[str, Any]) -> None:
        HeartbeatRun.objects.filter(pk=b.run.pk).update(**fields)

    return mutate


def _coordinator(**fields: Any) -> Mutation:
    def mutate(b: Binding, action: IssueRecoveryAction, receipt: dict[str, Any]) -> None:
        type(b.coordinator).objects.filter(pk=b.coordinator.pk).update(**fields)

    return mutate


def _issue(**fields: Any) -> Mutation:
    def mutate(b: Binding, action: IssueRecoveryAction, receipt: dict[str, Any]) -> None:
        type(b.issue).objects.filter(pk=b.issue.pk).update(**fields)

    return mutate


def _assignee_elsewhere(b: Binding, action: IssueRecoveryAction, receipt: dict[str, Any]) -> None:
    type(b.issue).objects.filter(pk=b.issue.pk).update(
        assignee_agent=AgentFactory(company=b.company)
    )


def _checkout_by_another_run(
    b: Binding, action: IssueRecoveryAction, receipt: dict[str, Any]
) -> None:
    other = NativeRunFactory(company=b.company, agent=b.agent, issue=b.issue, status="failed")
    HeartbeatRun.objects.filter(pk=other.pk).update(created_at=b.run.created_at)
    type(b.issue).objects.filter(pk=b.issue.pk).update(checkout_run=other)


def _rejected_result(b: Binding, action: IssueRecoveryAction, receipt: dict[str, Any]) -> None:
    assert b.result is not None
    NativeRunResult.objects.filter(pk=b.result.pk).update(schema_status="rejected")


def _newer_finished_run(b: Binding, action: IssueRecoveryAction, receipt: dict[str, Any]) -> None:
    NativeRunFactory(company=b.company, agent=b.agent, issue=b.issue, status="failed")


def _receipt_gone(b: Binding, action: IssueRecoveryAction, receipt: dict[str, Any]) -> None:
    HeartbeatRun.objects.filter(pk=b.run.pk).update(runner_profile_json={})


def _receipt_differs_from_evidence(
    b: Binding, action: IssueRecoveryAction, receipt: dict[str, Any]
) -> None:
    # Same token, but not the process the board was shown.
    HeartbeatRun.objects.filter(pk=b.run.pk).update(
        runner_profile_json={OWNER_KEY: {**receipt, "pid": receipt["pid"] + 1}}
    )


ADMISSION_CHECKS: dict[str, tuple[Mutation, str]] = {
    "action resolved": (_action(status="resolved"), "action_not_current"),
    "action cancelled": (_action(status="cancelled"), "action_not_current"),
    "action of another cause": (_action(cause="stranded_assigned_issue"), "action_not_current"),
    "action not board-owned": (_action(owner_type="agent"), "action_not_current"),
    "action of another kind": (_action(kind="workspace_validation"), "action_not_current"),
    "action for another run": (_evidence_run_id, "action_not_current"),
    "run not native": (_run(runtime_mode="legacy"), "run_not_current"),
    "run not running": (_run(status="succeeded"), "run_not_current"),
    "coordinator committed": (_coordinator(phase="committed"), "coordinator_not_waiting"),
    "coordinator observed": (_coordinator(phase="observed"), "coordinator_not_waiting"),
    "coordinator leased": (_coordinator(lease_owner="boot:1:lease"), "coordinator_not_waiting"),
    "no accepted result": (_coordinator(result=None), "coordinator_not_waiting"),
    "issue done": (_issue(status="done"), "issue_moved_on"),
    "issue cancelled": (_issue(status="cancelled"), "issue_moved_on"),
    "issue assigned to another agent": (_assignee_elsewhere, "issue_moved_on"),
    "result rejected": (_rejected_result, "result_not_bound"),
    "receipt already gone, nothing recorded": (_receipt_gone, "owner_changed"),
    "receipt differs from the recorded owner": (_receipt_differs_from_evidence, "owner_changed"),
}


@pytest.mark.parametrize(
    ("mutate", "reason"), ADMISSION_CHECKS.values(), ids=ADMISSION_CHECKS.keys()
)
def test_each_admission_check_refuses_and_changes_nothing(mutate: Mutation, reason: str) -> None:
    b, action, receipt, actor = held_binding()
    mutate(b, action, receipt)
    assert_stale(b, action, receipt["token"], actor, reason)
    assert not ActivityEvent.objects.filter(action="issue.workspace_owner_stop_confirmed").exists()


# A later run of the issue (which may hold its slots) is no predecessor rule over a held run
# (docs/recovery.md#one-hold-per-held-run): these no longer make the hold stale.
LATER_RUNS: dict[str, Mutation] = {
    "issue executed by nobody": _issue(execution_run=None),
    "issue checked out by another run": _checkout_by_another_run,
    "newer run (finished)": _newer_finished_run,
}


@pytest.mark.parametrize("mutate", LATER_RUNS.values(), ids=LATER_RUNS.keys())
def test_a_later_run_of_the_issue_leaves_the_hold_admissible(mutate: Mutation) -> None:
    b, action, receipt, actor = held_binding()
    mutate(b, action, receipt)
    assert confirm(b, action, receipt["token"], actor).status == "queued"


def test_the_unmutated_binding_is_admitted() -> None:
    """The control for the table above: each refusal comes from its own mutation."""
    b, action, receipt, actor = held_binding()
    assert confirm(b, action, receipt["token"], actor).status == "queued"


def _hold_lock(b: Binding) -> psycopg.Connection[Any]:
    other = raw_connection()
    other.execute("SET lock_timeout = '5s'")  # fail, never hang, if someone else holds it
    other.execute(
        "SELECT pg_advisory_lock(hashtextextended(%s, 0))",
        [finalization_lock_key(b.company.pk, b.run.pk)],
    )
    return other


@pytest.mark.django_db(transaction=True)
def test_a_repeat_answers_the_same_while_the_woken_reconciler_holds_the_lock() -> None:
    b, action, receipt, actor = held_binding()
    first = confirm(b, action, receipt["token"], actor)
    with _hold_lock(b):
        again = confirm(b, action, receipt["token"], actor)
        # A first confirmation would still be refused while copy-back may be running.
        other_b, other_action, other_receipt, other_actor = held_binding()
        with _hold_lock(other_b), pytest.raises(WorkspaceCopybackActive):
            confirm(other_b, other_action, other_receipt["token"], other_actor)
    assert (again.run_id, again.result_id, again.status, again.replayed) == (
        first.run_id,
        first.result_id,
        "queued",
        True,
    )
    assert ActivityEvent.objects.filter(action="issue.workspace_owner_stop_confirmed").count() == 1


def test_a_repeat_for_another_saved_result_is_not_a_replay() -> None:
    b, action, receipt, actor = held_binding()
    confirm(b, action, receipt["token"], actor)
    other = NativeRunResult.objects.create(
        company=b.company,
        issue=b.issue,
        run=b.run,
        completion_contract_id=b.run.completion_contract_id,
        server_fingerprint="another",
        schema_status="accepted",
        result_json={},
        canonical_sha256="0" * 64,
    )
    type(b.coordinator).objects.filter(pk=b.coordinator.pk).update(result=other)
    # The first confirmation released the receipt: there is no owner left to release.
    assert_stale(b, action, receipt["token"], actor, "owner_changed")


# --- races, each forced by a lock held from a separate connection --------------------------


def _confirm_in_thread(
    b: Binding, action: IssueRecoveryAction, token: str, actor: Any
) -> OwnerStopConfirmation:
    try:
        return confirm(b, action, token, actor)
    finally:
        connection.close()


@pytest.mark.django_db(transaction=True)
def test_an_issue_moved_out_of_the_company_while_the_confirmation_waits_is_a_missing_binding() -> (
    None
):
    """The locked re-read of the issue keeps its company filter, and a missing issue alone is
    refused: the issue leaves the company while the confirmation waits for its row."""
    b, action, receipt, actor = held_binding()
    elsewhere = CompanyFactory()
    issues = Issue._meta.db_table
    with raw_connection(autocommit=False) as holder:
        holder.execute(
            sql.SQL("UPDATE {} SET company_id = %s WHERE id = %s").format(sql.Identifier(issues)),
            [elsewhere.pk, b.issue.pk],
        )
        with ThreadPoolExecutor(max_workers=1) as pool:
            attempt = pool.submit(_confirm_in_thread, b, action, receipt["token"], actor)
            assert wait_for_lock_waiters(holder=holder, table=issues, until=attempt.done)
            holder.commit()
            with pytest.raises(WorkspaceOwnerRecoveryStale) as caught:
                attempt.result(timeout=LOCK_WAIT_TIMEOUT)
    assert caught.value.details == {"reason": "binding_missing"}
    assert HeartbeatRun.objects.get(pk=b.run.pk).runner_profile_json[OWNER_KEY] == receipt
    assert not ActivityEvent.objects.filter(action="issue.workspace_owner_stop_confirmed").exists()


@pytest.mark.django_db(transaction=True)
def test_a_confirmation_racing_the_first_is_its_replay_once_it_holds_the_locks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The second confirmation read the hold before the first committed (its unlocked replay
    check found no recorded stop) and takes the locks after: it answers as the first's replay
    instead of being refused for the receipt the first released."""
    monkeypatch.setattr(paperclip.db.locking, "HOT_PATH_LOCK_TIMEOUT", f"{LOCK_WAIT_TIMEOUT}s")
    b, action, receipt, actor = held_binding()
    audits = sql.Identifier(ActivityEvent._meta.db_table)
    coordinators = sql.Identifier(NativeRunFinalization._meta.db_table)
    with (
        raw_connection(autocommit=False) as audit_holder,
        raw_connection() as locker,
        ThreadPoolExecutor(max_workers=3) as pool,
    ):
        # The first confirmation stops at its audit row, holding its row locks.
        audit_holder.execute(sql.SQL("LOCK TABLE {} IN SHARE MODE").format(audits))
        first = pool.submit(_confirm_in_thread, b, action, receipt["token"], actor)
        assert wait_for_lock_waiters(1, until=first.done)
        # Queued behind the first's lock on the coordinators, an exclusive table lock makes
        # any later reader of that table wait behind it, until the first has committed.
        queued = pool.submit(
            locker.execute,
            sql.SQL("DO $$ BEGIN LOCK TABLE {} IN ACCESS EXCLUSIVE MODE; END $$").format(
                coordinators
            ),
        )
        assert wait_for_lock_waiters(2, until=queued.done)
        # The second reads the hold (no stop yet), then waits to read the coordinator.
        second = pool.submit(_confirm_in_thread, b, action, receipt["token"], actor)
        assert wait_for_lock_waiters(3, until=second.done)
        audit_holder.commit()
        answers = [first.result(timeout=LOCK_WAIT_TIMEOUT), second.result(LOCK_WAIT_TIMEOUT)]
        queued.result(timeout=LOCK_WAIT_TIMEOUT)
    assert [(a.run_id, a.result_id, a.replayed) for a in answers] == [
        (b.run.pk, b.result.pk, False),
        (b.run.pk, b.result.pk, True),
    ]
    assert ActivityEvent.objects.filter(action="issue.workspace_owner_stop_confirmed").count() == 1


def _earlier_action(b: Binding, receipt: dict[str, Any]) -> None:
    RecoveryActionFactory(id=FIRST_ID, source_issue=b.issue, status="resolved")


def _earlier_run_with_the_receipt(b: Binding, receipt: dict[str, Any]) -> None:
    HeartbeatRunFactory(
        id=FIRST_ID,
        company=b.company,
        agent=b.agent,
        status="failed",
        runner_profile_json={OWNER_KEY: receipt},
    )


def _earlier_coordinator(b: Binding, receipt: dict[str, Any]) -> None:
    earlier = NativeRunFactory(
        id=FIRST_ID, company=b.company, agent=b.agent, issue=b.issue, status="failed"
    )
    NativeRunFinalizationFactory(run=earlier, result=NativeRunResultFactory(run=earlier))


FIRST_ID = uuid.UUID(int=0)  # sorts before every other row: what a lookup without its key reads
REPEAT_LOOKALIKES: dict[str, Callable[[Binding, dict[str, Any]], None]] = {
    "an earlier action of the issue": _earlier_action,
    "an earlier run of the company still carrying the receipt": _earlier_run_with_the_receipt,
    "an earlier run's coordinator for the issue": _earlier_coordinator,
}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("add", REPEAT_LOOKALIKES.values(), ids=REPEAT_LOOKALIKES.keys())
def test_a_repeat_while_the_lock_is_held_reads_its_own_rows_not_the_first_of_the_company(
    add: Callable[[Binding, dict[str, Any]], None],
) -> None:
    """The repeat's unlocked lookups keep their keys: a row of the same kind that sorts first
    changes nothing, the repeat still answers without the lock."""
    b, action, receipt, actor = held_binding()
    confirm(b, action, receipt["token"], actor)
    add(b, receipt)
    with _hold_lock(b):
        again = confirm(b, action, receipt["token"], actor)
    assert (again.run_id, again.result_id, again.replayed) == (b.run.pk, b.result.pk, True)


def _moved(row: str, field: str) -> Mutation:
    """Move the binding's `row` to another company, or to another issue of the company."""

    def move(b: Binding, action: IssueRecoveryAction, receipt: dict[str, Any]) -> None:
        target = CompanyFactory() if field == "company" else IssueFactory(company=b.company)
        rows = {
            "action": IssueRecoveryAction.objects.filter(pk=action.pk),
            "run": HeartbeatRun.objects.filter(pk=b.run.pk),
            "coordinator": NativeRunFinalization.objects.filter(pk=b.coordinator.pk),
        }[row]
        rows.update(**{field: target})

    return move


REPEAT_MOVED: dict[str, Mutation] = {
    "action of another company": _moved("action", "company"),
    "action of another issue": _moved("action", "source_issue"),
    "run of another company": _moved("run", "company"),
    "coordinator of another company": _moved("coordinator", "company"),
    "coordinator of another issue": _moved("coordinator", "issue"),
}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("move", REPEAT_MOVED.values(), ids=REPEAT_MOVED.keys())
def test_a_repeat_whose_row_left_the_company_or_issue_is_no_replay_and_waits_for_the_lock(
    move: Mutation,
) -> None:
    """The repeat's unlocked lookups keep their company and issue filters: with a row moved
    out, it is no replay and goes on to the locked path, where the held lock refuses it."""
    b, action, receipt, actor = held_binding()
    confirm(b, action, receipt["token"], actor)
    move(b, action, receipt)
    with _hold_lock(b), pytest.raises(WorkspaceCopybackActive):
        confirm(b, action, receipt["token"], actor)
