"""An owner-unverified hold holds its run only while it names the run's current owner receipt
(docs/recovery.md#owner-unverified-hold). The receipt can change without the board: its owner
releases it, a platform-proof takeover replaces it, a later owner claims it. A hold left
naming an earlier owner can't be confirmed (`owner_changed`) nor dismissed, so it must not keep
the run held: the reconciler defers it, `finalize` queues it, and the next attempt either holds
the run for the current owner (superseding the old hold) or commits (resolving it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from django.test import override_settings
from procrastinate.contrib.django.models import ProcrastinateJob

from paperclip.access import board_actor
from paperclip.models import (
    BoardMembership,
    ExecutionWorkspace,
    HeartbeatRun,
    NativeRunFinalization,
)
from paperclip.receipts import OWNER_KEY
from recovery.adapters.platform import worker_stop_signature
from recovery.console.attention import attention_summary
from recovery.errors import WorkspaceOwnerRecoveryStale
from recovery.models import IssueRecoveryAction
from recovery.selectors.actions import OWNER_UNVERIFIED_CAUSE
from recovery.selectors.attention import held_finalization_actions
from recovery.selectors.finalization import finalization_state
from recovery.selectors.holds import board_holds
from recovery.services import (
    Acquired,
    NotAcquired,
    finalizations_reconcile,
    recovery_owner_stop_confirm,
    run_finalize,
)
from recovery.services.ownership.receipt_release import _remove_receipt
from recovery.services.worker_stops import worker_stop_record
from tests.helpers import run_jobs
from tests.paperclip.factories import UserFactory
from tests.paperclip.helpers import audit_count
from tests.recovery.factories import Binding, make_binding, receipt_for

pytestmark = pytest.mark.django_db(transaction=True)

EVIDENCE = "k8s: pod finalizer-7f9 terminated 12:03Z, no copy processes left on node"
SECRET = "stop-secret-for-tests"


def _live_owner_holds(run_id: Any) -> list[IssueRecoveryAction]:
    return list(
        IssueRecoveryAction.objects.filter(
            cause=OWNER_UNVERIFIED_CAUSE, status__in=("active", "escalated"), held_run_id=run_id
        )
    )


def _held_then_released_by_its_owner(
    tmp_path: Path,
) -> tuple[Binding, IssueRecoveryAction, dict[str, Any]]:
    """Owner A's lock connection was cut mid copy-back; a controller met A's receipt and held
    the run (the hold names A); then A released its own receipt, and the follow-up job it
    deferred failed with an exception (a database blip), which the worker does not retry."""
    owner_a = receipt_for(hostname="gone-a.example")
    b = make_binding(tmp_path=tmp_path, receipt=owner_a, phase="workspace_finalizing")
    outcome = run_finalize(company_id=b.company.pk, run_id=b.run.pk)
    assert outcome == NotAcquired("owner_unverified")
    (hold,) = _live_owner_holds(b.run.pk)
    _remove_receipt(company_id=b.company.pk, run_id=b.run.pk, token=owner_a["token"])
    (follow_up,) = ProcrastinateJob.objects.filter(status="todo")
    ProcrastinateJob.objects.filter(pk=follow_up.pk).update(status="failed")
    return b, hold, owner_a


def _board_confirm(b: Binding, hold: IssueRecoveryAction, token: str) -> Any:
    user = UserFactory()
    BoardMembership.objects.get_or_create(user=user, company=b.company)
    return recovery_owner_stop_confirm(
        actor=board_actor(user),
        issue_id=b.issue.pk,
        action_id=hold.pk,
        run_id=b.run.pk,
        owner_token=token,
        stop_evidence=EVIDENCE,
        controller_and_copyback_stopped=True,
    )


def test_a_hold_whose_owner_released_its_receipt_lets_the_run_commit(
    tmp_path: Path, make_agent_client: Any
) -> None:
    b, hold, owner_a = _held_then_released_by_its_owner(tmp_path)
    assert OWNER_KEY not in HeartbeatRun.objects.get(pk=b.run.pk).runner_profile_json
    with pytest.raises(WorkspaceOwnerRecoveryStale) as stale:
        _board_confirm(b, hold, owner_a["token"])
    assert stale.value.details == {"reason": "owner_changed"}

    response = make_agent_client(b.agent).post(f"/api/heartbeat-runs/{b.run.pk}/finalize")
    summary = finalizations_reconcile()
    run_jobs()

    phase = NativeRunFinalization.objects.get(pk=b.run.pk).phase
    assert (response.status_code, summary.skipped_held, phase) == (202, 0, "committed")
    hold.refresh_from_db()
    assert hold.status == IssueRecoveryAction.Status.RESOLVED
    assert _live_owner_holds(b.run.pk) == []


def test_a_hold_whose_owner_was_replaced_gives_way_to_a_hold_of_the_new_owner(
    tmp_path: Path,
) -> None:
    b, hold, owner_a = _held_then_released_by_its_owner(tmp_path)
    # Before its job failed, the follow-up's owner F had claimed (and its removal then gave up).
    owner_f = receipt_for(hostname="gone-f.example")
    HeartbeatRun.objects.filter(pk=b.run.pk).update(runner_profile_json={OWNER_KEY: owner_f})
    for token in (owner_a["token"], owner_f["token"]):
        with pytest.raises(WorkspaceOwnerRecoveryStale):
            _board_confirm(b, hold, token)
    superseded = audit_count("recovery_action.superseded")

    summary = finalizations_reconcile()
    run_jobs()

    holds = _live_owner_holds(b.run.pk)
    assert (summary.skipped_held, [h.evidence["owner"]["token"] for h in holds]) == (
        0,
        [owner_f["token"]],
    )
    hold.refresh_from_db()
    assert hold.status == IssueRecoveryAction.Status.CANCELLED
    assert audit_count("recovery_action.superseded") == superseded + 1


def _record_stop(run_id: Any, token: str, worker_id: str) -> None:
    stopped_at = "2026-01-02T03:04:05+00:00"
    worker_stop_record(
        run_id=run_id,
        owner_token=token,
        worker_id=worker_id,
        stopped_at=stopped_at,
        signature=worker_stop_signature(
            secret=SECRET,
            run_id=run_id,
            owner_token=token,
            worker_id=worker_id,
            stopped_at=stopped_at,
        ),
    )


@override_settings(PAPERCLIP_PLATFORM_STOP_SECRET=SECRET)
def test_a_run_taken_over_on_platform_proof_whose_copyback_failed_waits_for_its_retry(
    tmp_path: Path, make_agent_client: Any
) -> None:
    prior = receipt_for(hostname="pod-1.cluster", worker={"id": "pod-1"})
    b = make_binding(tmp_path=tmp_path, receipt=prior, phase="workspace_finalizing")
    assert run_finalize(company_id=b.company.pk, run_id=b.run.pk) == NotAcquired(
        "platform_stop_pending"
    )
    (hold,) = _live_owner_holds(b.run.pk)
    # The stop is reported; the next attempt takes over on the proof, and its copy-back fails
    # (the cwd is missing: a transient, retried failure).
    _record_stop(b.run.pk, prior["token"], "pod-1")
    ExecutionWorkspace.objects.filter(pk=b.workspace.pk).update(cwd=None)
    outcome = run_finalize(company_id=b.company.pk, run_id=b.run.pk)
    assert isinstance(outcome, Acquired), outcome
    assert outcome.value.status == "retry_scheduled"
    hold.refresh_from_db()
    assert hold.evidence["workspaceOwnerRecovery"] == {"state": "resuming"}
    with pytest.raises(WorkspaceOwnerRecoveryStale) as stale:
        _board_confirm(b, hold, prior["token"])
    assert stale.value.details == {"reason": "owner_changed"}

    state = finalization_state(HeartbeatRun.objects.get(pk=b.run.pk))
    response = make_agent_client(b.agent).post(f"/api/heartbeat-runs/{b.run.pk}/finalize")
    assert (state.state, state.reason, response.status_code) == ("retry_scheduled", None, 202)
    # Once the retry is due and no job waits, the reconciler defers one.
    NativeRunFinalization.objects.filter(pk=b.run.pk).update(next_attempt_at=None)
    ProcrastinateJob.objects.filter(status="todo").update(status="failed")
    assert finalizations_reconcile().skipped_held == 0


def test_a_hold_naming_an_earlier_owner_is_not_counted_listed_or_offered_as_held(
    tmp_path: Path,
) -> None:
    """The dashboard's "held for the board: owner unverified" tile, the list filter it opens
    and the hold's "Confirm owner stopped" button count a hold only while it names the run's
    current receipt, as the reconciler and `finalize` do."""
    owner_a = receipt_for(hostname="gone-a.example")
    b = make_binding(tmp_path=tmp_path, receipt=owner_a, phase="workspace_finalizing")
    assert run_finalize(company_id=b.company.pk, run_id=b.run.pk) == NotAcquired("owner_unverified")
    (hold,) = _live_owner_holds(b.run.pk)

    def counted() -> tuple[int, bool, bool]:
        summary = attention_summary(company_ids=[b.company.pk], include_jobs=False)
        (tile,) = (t for t in summary.tiles if t.detail == "owner_unverified")
        listed = board_holds(reason="owner_unverified").filter(pk=hold.pk).exists()
        return tile.count, listed, held_finalization_actions().filter(pk=hold.pk).exists()

    assert counted() == (1, True, True)
    owner_f = receipt_for(hostname="gone-f.example")  # a later owner claimed the run
    HeartbeatRun.objects.filter(pk=b.run.pk).update(runner_profile_json={OWNER_KEY: owner_f})
    assert counted() == (0, False, False)
    _remove_receipt(company_id=b.company.pk, run_id=b.run.pk, token=owner_f["token"])
    assert counted() == (0, False, False)  # released: no receipt at all
    HeartbeatRun.objects.filter(pk=b.run.pk).update(runner_profile_json={OWNER_KEY: owner_a})
    assert counted() == (1, True, True)  # the hold's own owner again
