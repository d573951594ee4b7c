"""recovery_owner_stop_confirm: admission, writes, idempotency, refusals."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest

from paperclip.access import board_actor
from paperclip.errors import InvalidRequest, NotFoundError
from paperclip.models import ActivityEvent, BoardMembership, HeartbeatRun, NativeRunResult
from paperclip.receipts import OWNER_KEY
from recovery.errors import (
    WorkspaceControllerAlive,
    WorkspaceCopybackActive,
    WorkspaceOwnerRecoveryStale,
)
from recovery.locks import finalization_lock_key
from recovery.models import IssueRecoveryAction
from recovery.services import recovery_owner_stop_confirm
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


def test_newer_queued_run_is_stale() -> None:
    b, action, receipt, actor = held_binding()
    HeartbeatRunFactory(
        company=b.company,
        agent=b.agent,
        issue=b.issue,
        native_issue=b.issue,
        status="queued",
        runtime_mode="native",
    )
    assert_stale(b, action, receipt["token"], actor, "newer_run")


def test_live_local_controller_is_refused() -> None:
    b, action, receipt, actor = held_binding(receipt=receipt_for())  # this very process
    with pytest.raises(WorkspaceControllerAlive):
        confirm(b, action, receipt["token"], actor)
    b.run.refresh_from_db()
    assert b.run.runner_profile_json[OWNER_KEY] == receipt


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
    b.issue.execution_run = None
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
    # The same hold, recorded against another issue of the company.
    fields = {
        f.name: getattr(hold, f.name)
        for f in IssueRecoveryAction._meta.concrete_fields
        if f.name not in ("id", "source_issue", "created_at", "updated_at")
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
