"""recovery_owner_stop_confirm: admission, writes, idempotency, refusals."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import connection
from procrastinate.contrib.django.models import ProcrastinateJob

from paperclip.access import board_actor
from paperclip.db.clock import db_now
from paperclip.errors import InvalidRequest, NotFoundError
from paperclip.models import (
    ActivityEvent,
    BoardMembership,
    HeartbeatRun,
    NativeRunFinalization,
    NativeRunResult,
)
from paperclip.receipts import OWNER_KEY
from recovery.adapters.identity import current_controller_identity
from recovery.errors import (
    WorkspaceControllerAlive,
    WorkspaceCopybackActive,
    WorkspaceOwnerRecoveryStale,
)
from recovery.locks import finalization_lock_key, finalization_queueing_lock
from recovery.models import IssueRecoveryAction
from recovery.services import recovery_owner_stop_confirm
from recovery.services.finalization_jobs import FINALIZE_TASK
from recovery.services.owner_stop import (
    MAX_STOP_EVIDENCE_CHARS,
    MIN_STOP_EVIDENCE_CHARS,
    QUEUED_NEXT_ACTION,
)
from tests.helpers import raw_connection
from tests.paperclip.factories import (
    CompanyFactory,
    HeartbeatRunFactory,
    IssueFactory,
    NativeRunFactory,
    NativeRunFinalizationFactory,
    NativeRunResultFactory,
    UserFactory,
)
from tests.recovery.factories import (
    Binding,
    RecoveryActionFactory,
    hold_for_board,
    make_binding,
    receipt_for,
)

pytestmark = pytest.mark.django_db

EVIDENCE = "k8s: pod finalizer-7f9 terminated 12:03Z, no copy processes left on node"


def held_binding(*, receipt: dict[str, Any] | None = None, phase: str = "workspace_finalizing"):
    receipt = receipt if receipt is not None else receipt_for(hostname="gone.example")
    b = make_binding(receipt=receipt, phase=phase)
    action = hold_for_board(b, receipt)
    user = UserFactory()
    BoardMembership.objects.create(user=user, company=b.company)
    return b, action, receipt, board_actor(user)


def confirm(b: Binding, action: IssueRecoveryAction, token: str, actor: Any, **kw: Any) -> Any:
    args: dict[str, Any] = {
        "actor": actor,
        "issue_id": b.issue.pk,
        "action_id": action.pk,
        "run_id": b.run.pk,
        "owner_token": token,
        "stop_evidence": EVIDENCE,
        "controller_and_copyback_stopped": True,
    }
    args.update(kw)
    return recovery_owner_stop_confirm(**args)


def assert_stale(
    b: Binding, action: IssueRecoveryAction, token: str, actor: Any, reason: str
) -> None:
    """The confirmation is refused as stale for `reason` and changes nothing: the receipt
    stays on the run, the action row is as it was, no confirmation is audited."""
    run_before = HeartbeatRun.objects.values().get(pk=b.run.pk)
    action_before = IssueRecoveryAction.objects.values().get(pk=action.pk)
    audits = ActivityEvent.objects.filter(action="issue.workspace_owner_stop_confirmed")
    audited_before = audits.count()
    with pytest.raises(WorkspaceOwnerRecoveryStale) as caught:
        confirm(b, action, token, actor)
    assert (caught.value.code, caught.value.details) == (
        "workspace_owner_recovery_stale",
        {"reason": reason},
    )
    run_after = HeartbeatRun.objects.values().get(pk=b.run.pk)
    assert run_after["runner_profile_json"] == run_before["runner_profile_json"]
    assert run_after == run_before
    assert IssueRecoveryAction.objects.values().get(pk=action.pk) == action_before
    assert audits.count() == audited_before


def test_confirmation_releases_exactly_the_receipt_and_records_the_stop() -> None:
    b, action, receipt, actor = held_binding()
    before_status, before_phase = b.run.status, b.coordinator.phase

    answer = confirm(b, action, receipt["token"], actor)

    assert (answer.run_id, answer.result_id, answer.status) == (b.run.pk, b.result.pk, "queued")
    b.refresh()
    action.refresh_from_db()
    assert OWNER_KEY not in b.run.runner_profile_json
    assert (b.run.status, b.coordinator.phase) == (before_status, before_phase)
    assert b.issue.execution_run_id == b.run.pk  # nothing else changes
    stop = action.evidence["workspaceOwnerStop"]
    assert stop["owner"] == receipt
    assert stop["resultId"] == str(b.result.pk)
    assert stop["actorId"] == str(actor.user.pk)
    assert stop["stopEvidence"] == EVIDENCE
    assert stop["confirmedAt"]
    assert action.status == "active"
    assert action.wake_policy is None
    audit = ActivityEvent.objects.get(action="issue.workspace_owner_stop_confirmed")
    assert (audit.actor_type, audit.entity_id) == ("user", str(b.issue.pk))
    assert audit.details["recoveryActionId"] == str(action.pk)


def test_repeat_is_idempotent_without_a_second_audit_row() -> None:
    b, action, receipt, actor = held_binding()
    first = confirm(b, action, receipt["token"], actor)
    again = confirm(b, action, receipt["token"], actor)
    assert (again.run_id, again.result_id, again.status) == (
        first.run_id,
        first.result_id,
        first.status,
    )
    assert again.replayed
    assert ActivityEvent.objects.filter(action="issue.workspace_owner_stop_confirmed").count() == 1


def test_repeat_never_releases_a_newer_owner() -> None:
    b, action, receipt, actor = held_binding()
    confirm(b, action, receipt["token"], actor)
    newer = receipt_for(hostname="gone.example")
    HeartbeatRun.objects.filter(pk=b.run.pk).update(runner_profile_json={OWNER_KEY: newer})
    confirm(b, action, receipt["token"], actor)
    b.run.refresh_from_db()
    assert b.run.runner_profile_json[OWNER_KEY] == newer


def test_wrong_token_is_stale() -> None:
    b, action, _receipt, actor = held_binding()
    assert_stale(b, action, "not-the-token", actor, "owner_changed")


def test_newer_owner_is_stale() -> None:
    b, action, receipt, actor = held_binding()
    newer = receipt_for(hostname="other.example")
    HeartbeatRun.objects.filter(pk=b.run.pk).update(runner_profile_json={OWNER_KEY: newer})
    assert_stale(b, action, receipt["token"], actor, "owner_changed")
    # Not the owner the action recorded, even with the current receipt's own token.
    assert_stale(b, action, newer["token"], actor, "owner_changed")
    b.run.refresh_from_db()
    assert b.run.runner_profile_json[OWNER_KEY] == newer


def test_malformed_receipt_is_stale() -> None:
    bad = {"token": "t-1", "hostname": "gone.example", "pid": -3, "processStartedAt": "never"}
    b, action, _receipt, actor = held_binding(receipt=bad)
    assert_stale(b, action, "t-1", actor, "owner_changed")


def test_missing_result_is_stale() -> None:
    b, action, receipt, actor = held_binding()
    b.coordinator.result = None
    b.coordinator.save()
    assert_stale(b, action, receipt["token"], actor, "coordinator_not_waiting")


def test_result_of_another_contract_is_stale() -> None:
    b, action, receipt, actor = held_binding()
    other = NativeRunResultFactory(
        run=b.run, completion_contract_id="00000000-0000-0000-0000-0000000000aa"
    )
    b.coordinator.result = other
    b.coordinator.save()
    assert_stale(b, action, receipt["token"], actor, "result_not_bound")


def test_a_newer_run_holding_the_issue_leaves_the_hold_current() -> None:
    """One hold per held run (docs/recovery.md#one-hold-per-held-run): a later run of the
    issue, even one that took its slots, never makes the held run's decision stale."""
    b, action, receipt, actor = held_binding()
    newer = HeartbeatRunFactory(
        company=b.company,
        agent=b.agent,
        issue=b.issue,
        native_issue=b.issue,
        status="running",
        runtime_mode="native",
    )
    b.issue.execution_run = b.issue.checkout_run = newer
    b.issue.save()
    assert confirm(b, action, receipt["token"], actor).status == "queued"


def test_live_local_controller_is_refused() -> None:
    b, action, receipt, actor = held_binding(receipt=receipt_for())  # this very process
    with pytest.raises(WorkspaceControllerAlive) as caught:
        confirm(b, action, receipt["token"], actor)
    # The refusal names the recorded process and why it can't be taken over.
    assert caught.value.details == {
        "hostname": receipt["hostname"],
        "pid": receipt["pid"],
        "reason": "controller_still_alive",
    }
    b.run.refresh_from_db()
    assert b.run.runner_profile_json[OWNER_KEY] == receipt


def test_a_live_local_controller_is_refused_after_the_clock_was_stepped() -> None:
    # Its wall-clock start recorded 15 s off, as after a step of the system clock since the
    # receipt was written: the ticks since boot still name this very process.
    me = current_controller_identity()
    stepped = receipt_for(
        started=me.process_started_at - timedelta(seconds=15), start_ticks=me.process_start_ticks
    )
    b, action, receipt, actor = held_binding(receipt=stepped)
    with pytest.raises(WorkspaceControllerAlive) as caught:
        confirm(b, action, receipt["token"], actor)
    assert caught.value.details["reason"] == "controller_still_alive"


def test_a_live_pid_of_this_host_name_under_another_kernel_boot_is_not_probed() -> None:
    # This very PID and start time, but another boot: after a reboot the PID is someone
    # else's, so its being alive here proves nothing; the board's verification decides.
    receipt = receipt_for(kernel_boot_id=str(uuid.uuid4()))
    b, action, receipt, actor = held_binding(receipt=receipt)
    confirm(b, action, receipt["token"], actor)
    b.run.refresh_from_db()
    assert OWNER_KEY not in b.run.runner_profile_json


def test_a_live_local_controller_of_a_receipt_without_kernel_boot_id_is_refused() -> None:
    b, action, receipt, actor = held_binding(receipt=receipt_for(legacy=True))
    with pytest.raises(WorkspaceControllerAlive):
        confirm(b, action, receipt["token"], actor)


def test_held_lock_is_refused() -> None:
    b, action, receipt, actor = held_binding()
    with raw_connection() as other:
        other.execute(
            "SELECT pg_advisory_lock(hashtextextended(%s, 0))",
            [finalization_lock_key(b.company.pk, b.run.pk)],
        )
        with pytest.raises(WorkspaceCopybackActive):
            confirm(b, action, receipt["token"], actor)
    b.run.refresh_from_db()
    assert b.run.runner_profile_json[OWNER_KEY] == receipt


def test_another_company_is_not_found() -> None:
    b, action, receipt, _actor = held_binding()
    outsider = UserFactory()
    BoardMembership.objects.create(user=outsider, company=CompanyFactory())
    with pytest.raises(NotFoundError):
        confirm(b, action, receipt["token"], board_actor(outsider))


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"controller_and_copyback_stopped": False}, "controller_and_copyback_stopped"),
        ({"stop_evidence": "   too short            \n   "}, "stop_evidence"),
    ],
)
def test_missing_checkbox_or_short_evidence_is_invalid(kw: dict[str, Any], field: str) -> None:
    b, action, receipt, actor = held_binding()
    with pytest.raises(InvalidRequest) as exc:
        confirm(b, action, receipt["token"], actor, **kw)
    assert field in exc.value.details["fields"]
    b.run.refresh_from_db()
    assert b.run.runner_profile_json[OWNER_KEY] == receipt


def test_resolved_action_or_moved_issue_is_stale() -> None:
    b, action, receipt, actor = held_binding()
    IssueRecoveryAction.objects.filter(pk=action.pk).update(status="resolved")
    assert_stale(b, action, receipt["token"], actor, "action_not_current")
    IssueRecoveryAction.objects.filter(pk=action.pk).update(status="active")
    b.issue.status = "done"
    b.issue.save()
    assert_stale(b, action, receipt["token"], actor, "issue_moved_on")


def test_confirmation_removes_only_the_receipt_from_the_runner_profile() -> None:
    """Found by `make mutate` (docs/testing.md): the rest of the profile is kept."""
    b, action, receipt, actor = held_binding()
    profile = {**b.run.runner_profile_json, "sessionState": {"kept": True}}
    HeartbeatRun.objects.filter(pk=b.run.pk).update(runner_profile_json=profile)
    confirm(b, action, receipt["token"], actor)
    b.run.refresh_from_db()
    assert b.run.runner_profile_json == {k: v for k, v in profile.items() if k != OWNER_KEY}
    assert b.run.runner_profile_json["sessionState"] == {"kept": True}


# --- found by `make mutate` (docs/testing.md) ------------------------------------------------


@pytest.mark.parametrize("lookalike", ["issue", "coordinator", "action"])
def test_confirmation_locks_its_own_rows_not_the_first_of_the_company(lookalike: str) -> None:
    """A row of the same kind in the company that sorts first by primary key (what a lookup
    without its key would read) changes nothing: the confirmation goes through."""
    b, action, receipt, actor = held_binding()
    first = uuid.UUID(int=0)
    if lookalike == "issue":
        IssueFactory(company=b.company, id=first)
    elif lookalike == "coordinator":
        earlier = NativeRunFactory(
            id=first, company=b.company, agent=b.agent, issue=b.issue, status="failed"
        )
        HeartbeatRun.objects.filter(pk=earlier.pk).update(
            created_at=b.run.created_at - timedelta(hours=1)
        )
        NativeRunFinalizationFactory(run=earlier, result=NativeRunResultFactory(run=earlier))
    else:
        RecoveryActionFactory(id=first, source_issue=b.issue, status="resolved")
    answer = confirm(b, action, receipt["token"], actor)
    assert (answer.run_id, answer.result_id, answer.replayed) == (b.run.pk, b.result.pk, False)
    action.refresh_from_db()
    assert action.evidence["workspaceOwnerStop"]["owner"] == receipt


def test_an_action_of_another_issue_is_not_this_runs_hold() -> None:
    b, hold, receipt, actor = held_binding()
    # The same hold, recorded against another issue of the company (naming the run in its
    # evidence only: a run has one live hold of a cause).
    fields = {
        f.name: getattr(hold, f.name)
        for f in IssueRecoveryAction._meta.concrete_fields
        if f.name not in ("id", "source_issue", "created_at", "updated_at", "held_run")
    }
    elsewhere = IssueRecoveryAction.objects.create(
        **fields, source_issue=IssueFactory(company=b.company)
    )
    assert_stale(b, elsewhere, receipt["token"], actor, "binding_missing")


def test_the_confirmation_is_audited_with_its_company_run_result_and_job() -> None:
    b, action, receipt, actor = held_binding()
    confirm(b, action, receipt["token"], actor)
    audit = ActivityEvent.objects.get(action="issue.workspace_owner_stop_confirmed")
    assert (audit.company_id, audit.actor_id, audit.entity_type, audit.run_id) == (
        b.company.pk,
        str(actor.user.pk),
        "issue",
        b.run.pk,
    )
    assert audit.details["resultId"] == str(b.result.pk)
    assert audit.details["owner"] == receipt
    assert audit.details["stopEvidence"] == EVIDENCE
    assert audit.details["finalizationJobId"] is not None


@pytest.mark.parametrize("elsewhere", ["company", "issue", "run"])
def test_a_saved_result_of_another_company_issue_or_run_is_not_bound(elsewhere: str) -> None:
    b, action, receipt, actor = held_binding()
    moved: dict[str, Any] = {
        "company": {"company": CompanyFactory()},
        "issue": {"issue": IssueFactory(company=b.company)},
        "run": {"run": HeartbeatRunFactory(company=b.company, agent=b.agent)},
    }[elsewhere]
    NativeRunResult.objects.filter(pk=b.result.pk).update(**moved)
    assert_stale(b, action, receipt["token"], actor, "result_not_bound")


def test_an_unknown_action_is_a_missing_binding() -> None:
    b, hold, receipt, actor = held_binding()
    IssueRecoveryAction.objects.filter(pk=hold.pk).update(id=uuid.uuid4())  # the id moves away
    with pytest.raises(WorkspaceOwnerRecoveryStale) as caught:
        confirm(b, hold, receipt["token"], actor)
    assert caught.value.details == {"reason": "binding_missing"}
    assert HeartbeatRun.objects.get(pk=b.run.pk).runner_profile_json[OWNER_KEY] == receipt


MOVED_ROWS: dict[str, Callable[[Binding, IssueRecoveryAction], None]] = {
    "coordinator of another company": lambda b, action: NativeRunFinalization.objects.filter(
        pk=b.coordinator.pk
    ).update(company=CompanyFactory()),
    "coordinator of another issue": lambda b, action: NativeRunFinalization.objects.filter(
        pk=b.coordinator.pk
    ).update(issue=IssueFactory(company=b.company)),
    "run of another company": lambda b, action: HeartbeatRun.objects.filter(pk=b.run.pk).update(
        company=CompanyFactory()
    ),
    "action of another company": lambda b, action: IssueRecoveryAction.objects.filter(
        pk=action.pk
    ).update(company=CompanyFactory()),
    "coordinator gone": lambda b, action: NativeRunFinalization.objects.filter(
        pk=b.coordinator.pk
    ).delete(),
}


@pytest.mark.parametrize("repeat", [False, True], ids=["first", "repeat"])
@pytest.mark.parametrize("moved", MOVED_ROWS.values(), ids=MOVED_ROWS.keys())
def test_a_binding_row_outside_the_company_or_issue_or_gone_is_a_missing_binding(
    moved: Callable[[Binding, IssueRecoveryAction], None], repeat: bool
) -> None:
    """Each locked lookup keeps its company and issue filters, and a missing row is refused
    on its own, before a first confirmation and before a repeat is taken for a replay."""
    b, action, receipt, actor = held_binding()
    if repeat:
        confirm(b, action, receipt["token"], actor)
    moved(b, action)
    assert_stale(b, action, receipt["token"], actor, "binding_missing")


@pytest.mark.parametrize("bound_by", ["issue", "native_issue"])
def test_a_newer_run_bound_to_the_issue_by_either_field_alone_is_not_a_stale_hold(
    bound_by: str,
) -> None:
    b, action, receipt, actor = held_binding()
    HeartbeatRunFactory(company=b.company, agent=b.agent, status="queued", **{bound_by: b.issue})
    assert confirm(b, action, receipt["token"], actor).status == "queued"


def test_the_confirmation_stamps_both_rows_with_database_time_and_clears_the_holds_policies() -> (
    None
):
    b, action, receipt, actor = held_binding()
    long_ago = datetime(2000, 1, 1, tzinfo=UTC)
    HeartbeatRun.objects.filter(pk=b.run.pk).update(updated_at=long_ago)
    IssueRecoveryAction.objects.filter(pk=action.pk).update(
        updated_at=long_ago, wake_policy={"every": "5m"}, monitor_policy={"watch": "run"}
    )
    started = db_now()  # the test's transaction, which the confirmation runs in
    confirm(b, action, receipt["token"], actor)
    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        (after,) = cursor.fetchone()
    assert started <= HeartbeatRun.objects.get(pk=b.run.pk).updated_at <= after
    row = IssueRecoveryAction.objects.values(
        "updated_at", "wake_policy", "monitor_policy", "next_action"
    ).get(pk=action.pk)
    assert started <= row.pop("updated_at") <= after
    assert row == {"wake_policy": None, "monitor_policy": None, "next_action": QUEUED_NEXT_ACTION}


def test_the_confirmation_queues_an_explicit_finalization_of_its_run() -> None:
    b, action, receipt, actor = held_binding()
    confirm(b, action, receipt["token"], actor)
    audit = ActivityEvent.objects.get(action="issue.workspace_owner_stop_confirmed")
    job = ProcrastinateJob.objects.get(pk=audit.details["finalizationJobId"])
    assert (job.task_name, job.queueing_lock, job.status, job.args) == (
        FINALIZE_TASK,
        finalization_queueing_lock(b.run.pk),
        "todo",
        {"company_id": str(b.company.pk), "run_id": str(b.run.pk), "explicit": True},
    )


def test_evidence_as_a_json_array_is_not_a_hold_of_this_run() -> None:
    b, action, receipt, actor = held_binding()
    IssueRecoveryAction.objects.filter(pk=action.pk).update(evidence=[action.evidence])
    assert_stale(b, action, receipt["token"], actor, "action_not_current")


def test_a_repeat_with_another_token_than_the_recorded_stop_is_not_a_replay() -> None:
    b, action, receipt, actor = held_binding()
    confirm(b, action, receipt["token"], actor)
    # The recorded stop names another owner, and the receipt is gone: nothing to release.
    assert_stale(b, action, "not-the-recorded-token", actor, "owner_changed")


def test_a_recorded_stop_whose_receipt_is_back_on_the_run_is_confirmed_again() -> None:
    """A replay needs the receipt gone: while the run still carries the very receipt, the
    confirmation releases it (again) instead of answering the earlier release."""
    b, action, receipt, actor = held_binding()
    confirm(b, action, receipt["token"], actor)
    HeartbeatRun.objects.filter(pk=b.run.pk).update(runner_profile_json={OWNER_KEY: receipt})
    again = confirm(b, action, receipt["token"], actor)
    assert (again.run_id, again.result_id, again.replayed) == (b.run.pk, b.result.pk, False)
    assert OWNER_KEY not in HeartbeatRun.objects.get(pk=b.run.pk).runner_profile_json
    assert ActivityEvent.objects.filter(action="issue.workspace_owner_stop_confirmed").count() == 2


def refused_fields(**kw: Any) -> dict[str, int]:
    """The fields a confirmation with these arguments is refused for (InvalidRequest), each
    with how many messages it got; every message is a non-blank string (text not asserted)."""
    b, action, receipt, actor = held_binding()
    with pytest.raises(InvalidRequest) as exc:
        confirm(b, action, receipt["token"], actor, **kw)
    fields = exc.value.details["fields"]
    assert all(isinstance(m, str) and m.strip() for msgs in fields.values() for m in msgs)
    assert HeartbeatRun.objects.get(pk=b.run.pk).runner_profile_json[OWNER_KEY] == receipt
    return {name: len(msgs) for name, msgs in fields.items()}


def admitted(**kw: Any) -> bool:
    b, action, receipt, actor = held_binding()
    return confirm(b, action, receipt["token"], actor, **kw).status == "queued"


def test_an_invalid_request_names_each_field_with_its_message() -> None:
    assert refused_fields(controller_and_copyback_stopped=False) == {
        "controller_and_copyback_stopped": 1
    }
    assert refused_fields(stop_evidence="too short") == {"stop_evidence": 1}
    assert refused_fields(controller_and_copyback_stopped=None, stop_evidence="") == {
        "controller_and_copyback_stopped": 1,
        "stop_evidence": 1,
    }


def test_evidence_needs_exactly_the_minimum_of_non_blank_characters() -> None:
    # Blanks between them don't count: 19 characters are one too few, 20 are enough.
    assert refused_fields(stop_evidence=" ".join("x" * (MIN_STOP_EVIDENCE_CHARS - 1))) == {
        "stop_evidence": 1
    }
    assert admitted(stop_evidence=" \n".join("x" * MIN_STOP_EVIDENCE_CHARS))


def test_evidence_of_exactly_the_maximum_length_is_accepted_one_more_is_not() -> None:
    assert admitted(stop_evidence="x" * MAX_STOP_EVIDENCE_CHARS)
    assert refused_fields(stop_evidence="x" * (MAX_STOP_EVIDENCE_CHARS + 1)) == {"stop_evidence": 1}
