"""with_finalization_ownership: every branch, on real connections (transaction=True: the
dedicated lock connection must see committed rows)."""

from __future__ import annotations

import os
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import connection

from paperclip.host import kernel_boot_id
from paperclip.models import ActivityEvent, HeartbeatRun, WorkspaceOperation
from paperclip.receipts import OWNER_KEY, STOP_PROOF_KEY, OwnerReceipt
from recovery.adapters.identity import (
    TakeoverDecision,
    current_controller_identity,
    evaluate_receipt_takeover,
)
from recovery.errors import FinalizationBindingMissing, FinalizationOwnershipLost
from recovery.locks import finalization_lock_key, recovery_source_key
from recovery.models import IssueRecoveryAction
from recovery.selectors.actions import OWNER_UNVERIFIED_CAUSE, owner_fingerprint
from recovery.services import (
    Acquired,
    FinalizationOwnership,
    NotAcquired,
    with_finalization_ownership,
)
from recovery.services.ownership import acquire, memory, prior_owner
from recovery.services.ownership.owner_hold import OWNER_UNVERIFIED_NEXT_ACTION
from tests.helpers import raw_connection, wait_for_lock_waiters
from tests.paperclip.factories import CompanyFactory, HeartbeatRunFactory, IssueFactory
from tests.recovery.factories import RecoveryActionFactory, make_binding, receipt_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.embedded]


def _profile(run: HeartbeatRun) -> dict[str, Any]:
    run.refresh_from_db()
    return dict(run.runner_profile_json or {})


def test_acquires_runs_the_action_with_our_receipt_and_removes_it_afterwards() -> None:
    b = make_binding()
    seen: dict[str, Any] = {}

    def action(own: FinalizationOwnership) -> str:
        seen["receipt"] = _profile(b.run)[OWNER_KEY]
        seen["token"] = own.token
        own.assert_held()
        return "done"

    outcome = with_finalization_ownership(company_id=b.company.pk, run_id=b.run.pk, action=action)
    assert outcome == Acquired("done")
    assert seen["receipt"]["token"] == seen["token"]
    assert seen["receipt"]["hostname"]
    assert seen["receipt"]["pid"] > 0
    assert seen["receipt"].get("kernelBootId") == kernel_boot_id()
    assert OWNER_KEY not in _profile(b.run)
    actions = set(ActivityEvent.objects.filter(run_id=b.run.pk).values_list("action", flat=True))
    assert {"run.finalization_owner_claimed", "run.finalization_owner_released"} <= actions


def test_a_first_claim_is_audited_with_the_receipt_it_wrote() -> None:
    b = make_binding()
    profile: dict[str, Any] = {}
    with_finalization_ownership(
        company_id=b.company.pk, run_id=b.run.pk, action=lambda own: profile.update(_profile(b.run))
    )
    written = profile[OWNER_KEY]
    # A claim without a platform stop proof records none (not even an empty one).
    assert STOP_PROOF_KEY not in profile
    claimed = ActivityEvent.objects.get(action="run.finalization_owner_claimed")
    assert (claimed.company_id, claimed.actor_type, claimed.actor_id) == (
        b.company.pk,
        "system",
        "finalization-controller",
    )
    assert (claimed.entity_type, claimed.entity_id, claimed.run_id) == (
        "heartbeat_run",
        str(b.run.pk),
        b.run.pk,
    )
    assert claimed.details == {"owner": written, "priorToken": None, "takeoverBasis": None}
    # The claim and the release, nothing else (no owner-stop verification without a proof).
    assert sorted(ActivityEvent.objects.values_list("action", flat=True)) == [
        "run.finalization_owner_claimed",
        "run.finalization_owner_released",
    ]


def test_the_release_of_the_receipt_is_audited_with_its_token() -> None:
    b = make_binding()
    tokens: list[str] = []
    with_finalization_ownership(
        company_id=b.company.pk, run_id=b.run.pk, action=lambda own: tokens.append(own.token)
    )
    released = ActivityEvent.objects.get(action="run.finalization_owner_released")
    assert (released.company_id, released.actor_type, released.actor_id) == (
        b.company.pk,
        "system",
        "finalization-controller",
    )
    assert (released.entity_type, released.entity_id, released.run_id) == (
        "heartbeat_run",
        str(b.run.pk),
        b.run.pk,
    )
    assert released.details == {"token": tokens[0]}


def test_every_owner_gets_its_own_receipt_token() -> None:
    """The receipt's token is what tells one owner from the next (the compare-and-set and the
    release both match on it): two finalizations never share one."""
    tokens: list[str] = []
    for _ in range(2):
        b = make_binding()
        with_finalization_ownership(
            company_id=b.company.pk, run_id=b.run.pk, action=lambda own: tokens.append(own.token)
        )
    assert len(set(tokens)) == 2
    assert all(str(uuid.UUID(token)) == token for token in tokens)


def test_a_non_native_run_is_a_binding_error() -> None:
    run = HeartbeatRunFactory(runtime_mode="legacy")
    with pytest.raises(FinalizationBindingMissing):
        with_finalization_ownership(company_id=run.company_id, run_id=run.pk, action=lambda o: 1)


@pytest.mark.django_db  # refused before it touches anything: nothing to commit or flush
def test_refuses_to_run_inside_a_transaction() -> None:
    b = make_binding()
    from django.db import transaction

    with transaction.atomic(), pytest.raises(RuntimeError) as refused:
        with_finalization_ownership(company_id=b.company.pk, run_id=b.run.pk, action=lambda o: 1)
    assert str(refused.value) == (
        "with_finalization_ownership() must run outside transaction.atomic(): "
        "its progress writes commit on their own"
    )


@pytest.mark.parametrize("worker_id", ["pod-3", ""])
def test_the_receipt_names_this_processs_worker_when_the_platform_knows_it(
    worker_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A later controller asks the platform whether the worker named here has stopped; a
    process outside any known worker names none (no `worker` key, not a null one)."""
    monkeypatch.setenv("PAPERCLIP_WORKER_ID", worker_id)
    b = make_binding()
    profile: dict[str, Any] = {}
    with_finalization_ownership(
        company_id=b.company.pk, run_id=b.run.pk, action=lambda own: profile.update(_profile(b.run))
    )
    receipt = profile[OWNER_KEY]
    if worker_id:
        assert receipt["worker"] == {"id": "pod-3", "platform": "signed-receipt"}
    else:
        assert "worker" not in receipt


def test_same_process_second_controller_gets_owner_active() -> None:
    b = make_binding()
    inside, release = threading.Event(), threading.Event()

    def hold(own: FinalizationOwnership) -> str:
        inside.set()
        assert release.wait(timeout=10)
        return "first"

    def first() -> Any:
        try:
            return with_finalization_ownership(
                company_id=b.company.pk, run_id=b.run.pk, action=hold
            )
        finally:
            connection.close()

    ran = []
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(first)
        assert inside.wait(timeout=10)
        try:
            second = with_finalization_ownership(
                company_id=b.company.pk, run_id=b.run.pk, action=lambda o: ran.append(1)
            )
        finally:
            release.set()
        assert future.result(timeout=10) == Acquired("first")
    assert second == NotAcquired("owner_active")
    assert ran == []


@pytest.mark.parametrize("holder", ["another_backend", "another_alias_of_this_process"])
def test_a_finalization_key_held_outside_this_connection_alias_is_busy(holder: str) -> None:
    """Another backend holds the run's finalization key: `busy`, not `owner_active`, even when
    this process finalizes the run through another database alias."""
    b = make_binding()
    run_key = finalization_lock_key(b.company.pk, b.run.pk)
    if holder == "another_alias_of_this_process":
        with memory.memory_lock:
            memory.active_run_owners[run_key] = ("their-token", "other-alias")
    ran = []
    with raw_connection(autocommit=False) as other:
        other.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", [run_key])
        outcome = with_finalization_ownership(
            company_id=b.company.pk, run_id=b.run.pk, action=lambda o: ran.append(1)
        )
    assert outcome == NotAcquired("busy")
    assert ran == []
    assert OWNER_KEY not in _profile(b.run)


def test_a_finished_finalization_leaves_no_owner_of_this_process_behind() -> None:
    """After its receipt is released, this process no longer counts as the run's owner: a key
    held elsewhere afterwards is `busy`, not `owner_active`."""
    b = make_binding()
    args = {"company_id": b.company.pk, "run_id": b.run.pk}
    assert with_finalization_ownership(**args, action=lambda o: "done") == Acquired("done")
    with raw_connection(autocommit=False) as other:
        other.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))",
            [finalization_lock_key(b.company.pk, b.run.pk)],
        )
        assert with_finalization_ownership(**args, action=lambda o: 1) == NotAcquired("busy")


def test_foreign_host_receipt_becomes_a_board_action_and_nothing_is_written() -> None:
    prior = receipt_for(hostname="build-worker-7.elsewhere.example")
    b = make_binding(receipt=prior)
    before = _profile(b.run)
    ran = []

    outcome = with_finalization_ownership(
        company_id=b.company.pk, run_id=b.run.pk, action=lambda o: ran.append(1)
    )

    assert outcome == NotAcquired("owner_unverified")
    assert ran == []
    assert _profile(b.run) == before
    assert not WorkspaceOperation.objects.filter(heartbeat_run_id=b.run.pk).exists()
    action = IssueRecoveryAction.objects.get(source_issue=b.issue)
    assert action.kind == "active_run_watchdog"
    assert action.cause == OWNER_UNVERIFIED_CAUSE
    assert action.owner_type == "board"
    assert action.status == "active"
    assert action.wake_policy is None
    assert action.max_attempts == 1
    assert action.return_owner_agent_id == b.agent.pk
    assert action.fingerprint == owner_fingerprint(b.run.pk, prior)
    assert action.evidence == {
        "runId": str(b.run.pk),
        "owner": prior,
        "workspaceOwnerRecovery": {"state": "operator_required"},
    }
    assert action.next_action == OWNER_UNVERIFIED_NEXT_ACTION


def test_repeated_sweeps_restore_the_hold_text_and_spend_no_attempts() -> None:
    prior = receipt_for(hostname="elsewhere.example")
    b = make_binding(receipt=prior)
    with_finalization_ownership(company_id=b.company.pk, run_id=b.run.pk, action=lambda o: 1)
    action = IssueRecoveryAction.objects.get(source_issue=b.issue)
    # Something (e.g. a generic sweep) overwrote the copy-back-specific instructions.
    IssueRecoveryAction.objects.filter(pk=action.pk).update(
        next_action="Start a replacement run.",
        evidence={**action.evidence, "workspaceOwnerRecovery": {"state": "resuming"}},
    )
    for _ in range(3):
        outcome = with_finalization_ownership(
            company_id=b.company.pk, run_id=b.run.pk, action=lambda o: 1
        )
        assert outcome == NotAcquired("owner_unverified")
    action.refresh_from_db()
    assert action.status == "active"  # not escalated by a second upsert
    assert action.attempt_count == 1
    assert action.next_action == OWNER_UNVERIFIED_NEXT_ACTION
    assert action.evidence["workspaceOwnerRecovery"] == {"state": "operator_required"}
    assert IssueRecoveryAction.objects.filter(source_issue=b.issue).count() == 1
    restored = ActivityEvent.objects.filter(action="recovery_action.owner_hold_restored")
    assert restored.count() == 1  # only the sweep that changed something wrote a row
    row = restored.get()
    assert (row.company_id, row.actor_type, row.actor_id) == (
        b.company.pk,
        "system",
        "finalization-controller",
    )
    assert (row.entity_type, row.entity_id, row.run_id) == (
        "issue_recovery_action",
        str(action.pk),
        b.run.pk,
    )
    assert row.details == {"fingerprint": owner_fingerprint(b.run.pk, prior)}


def test_a_hold_for_another_owner_supersedes_the_live_one_as_the_finalization_controller() -> None:
    """The hold names one physical owner: when the run's recorded owner changes, the sweep
    cancels the old hold and records a new one (not an edit of the old), audited as the
    finalization controller."""
    first, second = receipt_for(hostname="pod-1.example"), receipt_for(hostname="pod-2.example")
    b = make_binding(receipt=first)
    with_finalization_ownership(company_id=b.company.pk, run_id=b.run.pk, action=lambda o: 1)
    old = IssueRecoveryAction.objects.get(source_issue=b.issue)
    HeartbeatRun.objects.filter(pk=b.run.pk).update(runner_profile_json={OWNER_KEY: second})
    outcome = with_finalization_ownership(
        company_id=b.company.pk, run_id=b.run.pk, action=lambda o: 1
    )
    assert outcome == NotAcquired("owner_unverified")
    old.refresh_from_db()
    new = IssueRecoveryAction.objects.get(source_issue=b.issue, status="active")
    assert old.status == "cancelled"
    assert new.fingerprint == owner_fingerprint(b.run.pk, second) != old.fingerprint
    assert (new.owner_type, new.wake_policy) == ("board", None)
    superseded = ActivityEvent.objects.get(action="recovery_action.superseded")
    assert (superseded.actor_type, superseded.actor_id, superseded.entity_id) == (
        "system",
        "finalization-controller",
        str(new.pk),
    )


def test_a_resolved_hold_is_not_restored_a_new_one_is_recorded() -> None:
    prior = receipt_for(hostname="elsewhere.example")
    b = make_binding(receipt=prior)
    with_finalization_ownership(company_id=b.company.pk, run_id=b.run.pk, action=lambda o: 1)
    old = IssueRecoveryAction.objects.get(source_issue=b.issue)
    IssueRecoveryAction.objects.filter(pk=old.pk).update(
        status="resolved", next_action="Start a replacement run."
    )
    with_finalization_ownership(company_id=b.company.pk, run_id=b.run.pk, action=lambda o: 1)
    live = IssueRecoveryAction.objects.get(source_issue=b.issue, status="active")
    assert live.pk != old.pk
    assert not ActivityEvent.objects.filter(action="recovery_action.owner_hold_restored").exists()


def test_a_hold_whose_owner_stop_is_recorded_is_not_restored() -> None:
    """Once the board has recorded the owner's stop on the hold, a sweep leaves its text alone."""
    b = make_binding(receipt=receipt_for(hostname="elsewhere.example"))
    with_finalization_ownership(company_id=b.company.pk, run_id=b.run.pk, action=lambda o: 1)
    hold = IssueRecoveryAction.objects.get(source_issue=b.issue)
    evidence = {**hold.evidence, "workspaceOwnerStop": {"confirmedAt": "2026-12-01T00:00:00Z"}}
    IssueRecoveryAction.objects.filter(pk=hold.pk).update(
        next_action="Finalization queued.", evidence=evidence
    )
    with_finalization_ownership(company_id=b.company.pk, run_id=b.run.pk, action=lambda o: 1)
    hold.refresh_from_db()
    assert (hold.next_action, hold.evidence) == ("Finalization queued.", evidence)
    assert not ActivityEvent.objects.filter(action="recovery_action.owner_hold_restored").exists()


def test_a_repeated_sweep_restores_its_own_issues_hold_not_the_companys_newest() -> None:
    mine = make_binding(receipt=receipt_for(hostname="pod-1.example"))
    theirs = make_binding(company=mine.company, receipt=receipt_for(hostname="pod-2.example"))
    for b in (mine, theirs):  # their hold is the company's most recently updated one
        with_finalization_ownership(company_id=b.company.pk, run_id=b.run.pk, action=lambda o: 1)
    hold = IssueRecoveryAction.objects.get(source_issue=mine.issue)
    IssueRecoveryAction.objects.filter(pk=hold.pk).update(next_action="Start a replacement run.")
    with_finalization_ownership(company_id=mine.company.pk, run_id=mine.run.pk, action=lambda o: 1)
    hold.refresh_from_db()
    assert (hold.status, hold.attempt_count) == ("active", 1)  # restored, not a spent attempt
    assert hold.next_action == OWNER_UNVERIFIED_NEXT_ACTION
    restored = ActivityEvent.objects.get(action="recovery_action.owner_hold_restored")
    assert restored.entity_id == str(hold.pk)


def test_a_repeated_sweep_restores_the_hold_only_under_the_issues_recovery_key() -> None:
    """The single writer of an issue's live recovery action holds its per-issue key: a sweep
    that finds the hold to restore waits for that key and restores the hold once it is let go."""
    b = make_binding(receipt=receipt_for(hostname="elsewhere.example"))
    with_finalization_ownership(company_id=b.company.pk, run_id=b.run.pk, action=lambda o: 1)
    hold = IssueRecoveryAction.objects.get(source_issue=b.issue)
    IssueRecoveryAction.objects.filter(pk=hold.pk).update(next_action="Start a replacement run.")

    def sweep() -> Any:
        try:
            return with_finalization_ownership(
                company_id=b.company.pk, run_id=b.run.pk, action=lambda o: 1
            )
        finally:
            connection.close()

    with raw_connection(autocommit=False) as writer:
        writer.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))",
            [recovery_source_key(b.company.pk, b.issue.pk)],
        )
        with ThreadPoolExecutor(max_workers=1) as pool:
            future = pool.submit(sweep)
            waited = wait_for_lock_waiters(1, until=future.done)
            unrestored = IssueRecoveryAction.objects.get(pk=hold.pk).next_action
            writer.rollback()
            outcome = future.result(timeout=30)
    assert waited, f"the sweep did not wait for the issue's recovery key: {outcome}"
    assert unrestored == "Start a replacement run."
    assert outcome == NotAcquired("owner_unverified")
    assert IssueRecoveryAction.objects.get(pk=hold.pk).next_action == OWNER_UNVERIFIED_NEXT_ACTION


def test_malformed_receipt_needs_the_board() -> None:
    b = make_binding(receipt={"token": "x", "pid": "not-a-pid"})
    outcome = with_finalization_ownership(
        company_id=b.company.pk, run_id=b.run.pk, action=lambda o: 1
    )
    assert outcome == NotAcquired("owner_unverified")
    action = IssueRecoveryAction.objects.get(source_issue=b.issue)
    assert action.evidence["owner"] == {"token": "x", "pid": "not-a-pid"}


def test_live_same_host_controller_is_not_taken_over() -> None:
    # Our own pid and start time, but another boot: e.g. a restarted worker thread pool.
    prior = receipt_for()
    b = make_binding(receipt=prior)
    outcome = with_finalization_ownership(
        company_id=b.company.pk, run_id=b.run.pk, action=lambda o: 1
    )
    assert outcome == NotAcquired("owner_unverified")
    assert _profile(b.run)[OWNER_KEY] == prior


def test_dead_same_host_controller_without_barrier_is_not_taken_over(dead_pid: int) -> None:
    prior = receipt_for(pid=dead_pid)
    b = make_binding(receipt=prior)
    outcome = with_finalization_ownership(
        company_id=b.company.pk, run_id=b.run.pk, action=lambda o: 1
    )
    assert outcome == NotAcquired("owner_unverified")
    assert _profile(b.run)[OWNER_KEY] == prior


def _barrier(b: Any) -> None:
    WorkspaceOperation.objects.create(
        company=b.company,
        heartbeat_run=b.run,
        issue=b.issue,
        phase="workspace_finalize",
        status="succeeded",
    )


@pytest.mark.parametrize("alive", [False, True])
def test_a_controller_of_this_host_name_but_another_kernel_boot_is_never_probed(
    dead_pid: int, alive: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Dead (or alive with its very start time) here, with the barrier: were the PID probed,
    # the dead one would be taken over; but it may be a PID reused since a reboot.
    probed: list[int] = []

    def probe(receipt: OwnerReceipt) -> TakeoverDecision:
        probed.append(receipt.pid)
        return evaluate_receipt_takeover(receipt)

    monkeypatch.setattr(prior_owner, "evaluate_receipt_takeover", probe)
    prior = receipt_for(pid=os.getpid() if alive else dead_pid, kernel_boot_id=str(uuid.uuid4()))
    b = make_binding(receipt=prior)
    _barrier(b)
    outcome = with_finalization_ownership(
        company_id=b.company.pk, run_id=b.run.pk, action=lambda o: 1
    )
    assert outcome == NotAcquired("owner_unverified")
    assert probed == []
    assert _profile(b.run)[OWNER_KEY] == prior
    assert IssueRecoveryAction.objects.get(source_issue=b.issue).evidence["owner"] == prior


def test_a_receipt_from_before_kernel_boot_ids_is_judged_by_host_name_pid_and_start(
    dead_pid: int,
) -> None:
    prior = receipt_for(pid=dead_pid, legacy=True)
    assert "kernelBootId" not in prior
    b = make_binding(receipt=prior)
    _barrier(b)
    outcome = with_finalization_ownership(
        company_id=b.company.pk, run_id=b.run.pk, action=lambda o: 1
    )
    assert outcome == Acquired(1)
    takeover = ActivityEvent.objects.get(action="run.finalization_owner_takeover")
    assert takeover.details["takeoverBasis"] == "controller_process_dead+copyback_barrier"


def test_dead_same_host_controller_with_barrier_is_taken_over(dead_pid: int) -> None:
    prior = receipt_for(pid=dead_pid)
    b = make_binding(receipt=prior)
    WorkspaceOperation.objects.create(
        company=b.company,
        heartbeat_run=b.run,
        issue=b.issue,
        phase="workspace_finalize",
        status="succeeded",
    )
    outcome = with_finalization_ownership(
        company_id=b.company.pk, run_id=b.run.pk, action=lambda o: o.token
    )
    assert isinstance(outcome, Acquired)
    assert OWNER_KEY not in _profile(b.run)
    takeover = ActivityEvent.objects.get(action="run.finalization_owner_takeover")
    assert takeover.details["priorToken"] == prior["token"]
    assert takeover.details["takeoverBasis"] == "controller_process_dead+copyback_barrier"


@pytest.mark.parametrize(
    "elsewhere", ["another_run", "another_issue", "another_company", "other_phase", "failed"]
)
def test_only_this_runs_succeeded_finalize_operation_is_a_copyback_barrier(
    dead_pid: int, elsewhere: str
) -> None:
    """A dead parent's orphaned copy children are proven finished only by the succeeded
    workspace_finalize operation of this run, issue and company; any other operation leaves
    the receipt to the board."""
    prior = receipt_for(pid=dead_pid)
    b = make_binding(receipt=prior)
    fields: dict[str, Any] = {
        "company": b.company,
        "heartbeat_run": b.run,
        "issue": b.issue,
        "phase": "workspace_finalize",
        "status": "succeeded",
    }
    if elsewhere == "another_run":
        fields["heartbeat_run"] = HeartbeatRunFactory(company=b.company, agent=b.agent)
    elif elsewhere == "another_issue":
        fields["issue"] = IssueFactory(company=b.company)
    elif elsewhere == "another_company":
        fields["company"] = CompanyFactory()
    elif elsewhere == "other_phase":
        fields["phase"] = "workspace_prepare"
    else:
        fields["status"] = "failed"
    WorkspaceOperation.objects.create(**fields)
    outcome = with_finalization_ownership(
        company_id=b.company.pk, run_id=b.run.pk, action=lambda o: 1
    )
    assert outcome == NotAcquired("owner_unverified")
    assert _profile(b.run)[OWNER_KEY] == prior
    assert not ActivityEvent.objects.filter(action="run.finalization_owner_takeover").exists()


def test_recycled_pid_counts_as_dead(dead_pid: int) -> None:
    # Our own live pid, recorded with a start time an hour earlier: a recycled pid.
    started = datetime.now(tz=UTC) - timedelta(hours=1)
    prior = receipt_for(pid=os.getpid(), started=started)
    b = make_binding(receipt=prior)
    WorkspaceOperation.objects.create(
        company=b.company,
        heartbeat_run=b.run,
        issue=b.issue,
        phase="workspace_finalize",
        status="succeeded",
    )
    outcome = with_finalization_ownership(
        company_id=b.company.pk, run_id=b.run.pk, action=lambda o: 1
    )
    assert outcome == Acquired(1)


def test_a_live_controller_is_not_taken_over_after_the_clock_was_stepped() -> None:
    # Our own live process, its wall-clock start recorded 15 s off as after a step of the
    # system clock, beside the barrier that would let a recycled pid be taken over: the ticks
    # since boot still name this very process.
    me = current_controller_identity()
    started = me.process_started_at + timedelta(seconds=15)
    prior = receipt_for(started=started, start_ticks=me.process_start_ticks)
    b = make_binding(receipt=prior)
    _barrier(b)
    outcome = with_finalization_ownership(
        company_id=b.company.pk, run_id=b.run.pk, action=lambda o: 1
    )
    assert outcome == NotAcquired("owner_unverified")
    assert _profile(b.run)[OWNER_KEY] == prior


@pytest.mark.parametrize("prior", ["none", "replaceable"])
def test_binding_changed_when_the_receipt_changes_between_read_and_swap(prior: str) -> None:
    """Both branches of the compare-and-swap: with no prior receipt, and with a prior judged
    replaceable (a recycled pid beside a succeeded copy-back barrier). Another controller
    writes its own receipt between the read and the swap: the swap compares against what was
    judged, fails, and leaves the newer receipt alone."""
    if prior == "none":
        b = make_binding()
    else:
        started = datetime.now(tz=UTC) - timedelta(hours=1)
        b = make_binding(receipt=receipt_for(pid=os.getpid(), started=started))
        WorkspaceOperation.objects.create(
            company=b.company,
            heartbeat_run=b.run,
            issue=b.issue,
            phase="workspace_finalize",
            status="succeeded",
        )
    intruder = receipt_for(hostname="elsewhere.example")

    def change_receipt() -> None:
        HeartbeatRun.objects.filter(pk=b.run.pk).update(
            runner_profile_json={**_profile(b.run), OWNER_KEY: intruder}
        )

    acquire.before_claim_hook = change_receipt
    ran = []
    outcome = with_finalization_ownership(
        company_id=b.company.pk, run_id=b.run.pk, action=lambda o: ran.append(1)
    )
    assert outcome == NotAcquired("binding_changed")
    assert ran == []
    assert _profile(b.run)[OWNER_KEY] == intruder  # the newer receipt is left alone
    assert not ActivityEvent.objects.filter(action__startswith="run.finalization_owner").exists()
    assert not memory.active_owner_tokens
    assert not memory.active_run_owners


def test_terminated_lock_connection_fails_assert_held_and_admits_no_second_owner() -> None:
    b = make_binding()
    inside, checked = threading.Event(), threading.Event()
    backend: dict[str, int] = {}
    errors: list[BaseException] = []

    def action(own: FinalizationOwnership) -> None:
        backend["pid"] = own.lock_backend_pid
        inside.set()
        assert checked.wait(timeout=10)
        try:
            own.assert_held()
        except FinalizationOwnershipLost as exc:
            errors.append(exc)
            raise

    def controller() -> Any:
        try:
            return with_finalization_ownership(
                company_id=b.company.pk, run_id=b.run.pk, action=action
            )
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(controller)
        assert inside.wait(timeout=10)
        receipt = _profile(b.run)[OWNER_KEY]
        with raw_connection() as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", [backend["pid"]])
        # The lock is gone with its session, but the receipt still fences the run.
        second = with_finalization_ownership(
            company_id=b.company.pk, run_id=b.run.pk, action=lambda o: "stolen"
        )
        assert second == NotAcquired("owner_active")
        # A retained repair of the run is never told owner_active: it answers owner_unverified.
        repair = RecoveryActionFactory(company=b.company, source_issue=b.issue)
        assert with_finalization_ownership(
            company_id=b.company.pk,
            run_id=b.run.pk,
            action=lambda o: "stolen",
            retained_repair_action_id=repair.pk,
        ) == NotAcquired("owner_unverified")
        assert _profile(b.run)[OWNER_KEY] == receipt
        checked.set()
        with pytest.raises(FinalizationOwnershipLost):
            future.result(timeout=10)
    assert len(errors) == 1
    assert errors[0].reason == "lock_connection_lost"
    assert OWNER_KEY not in _profile(b.run)  # its own cleanup removed only its receipt


def test_same_boot_joined_token_is_taken_over_after_failed_cleanup() -> None:
    b = make_binding()
    from recovery.adapters.identity import current_controller_identity

    me = current_controller_identity()
    prior = receipt_for(boot_id=me.boot_id)
    HeartbeatRun.objects.filter(pk=b.run.pk).update(
        runner_profile_json={**_profile(b.run), OWNER_KEY: prior}
    )
    # Without join evidence our own live-looking receipt is never taken over...
    assert with_finalization_ownership(
        company_id=b.company.pk, run_id=b.run.pk, action=lambda o: 1
    ) == NotAcquired("owner_unverified")
    IssueRecoveryAction.objects.all().delete()
    # ...with it (the action finished, the receipt removal failed) this boot may.
    with memory.memory_lock:
        memory.joined_owner_tokens.add(prior["token"])
    assert with_finalization_ownership(
        company_id=b.company.pk, run_id=b.run.pk, action=lambda o: 2
    ) == Acquired(2)
    assert prior["token"] not in memory.joined_owner_tokens
