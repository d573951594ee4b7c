"""The held finalization's verdict, in words: one case per kind of recorded owner."""

from __future__ import annotations

import os
import uuid
from datetime import timedelta

import pytest

from paperclip.models import WorkspaceOperation
from paperclip.models import WorkspaceOperation as Op
from recovery.adapters.identity import current_controller_identity
from recovery.models import WorkerStopReceipt
from recovery.selectors.verdict import owner_hold_verdict
from tests.console.helpers import held
from tests.recovery.factories import exited_pid, receipt_for

pytestmark = pytest.mark.django_db


def test_foreign_host(company) -> None:
    _, action, _ = held(company, receipt=receipt_for(hostname="elsewhere.example"))
    verdict = owner_hold_verdict(action)
    assert verdict.kind == "foreign_host"
    assert "another host (elsewhere.example" in verdict.headline
    assert verdict.confirmable


def test_same_host_alive(company) -> None:
    _, action, _ = held(company, receipt=receipt_for(pid=os.getpid()))
    verdict = owner_hold_verdict(action)
    assert verdict.kind == "same_host_alive"
    assert f"process {os.getpid()} is still alive" in verdict.headline
    assert not verdict.confirmable


@pytest.mark.parametrize("step", [timedelta(seconds=-15), timedelta(seconds=15)])
def test_same_host_alive_after_the_clock_was_stepped(company, step: timedelta) -> None:
    # The receipt's wall-clock start is off by the step, as after NTP stepped the clock since
    # it was written; its ticks since boot are not.
    me = current_controller_identity()
    receipt = receipt_for(started=me.process_started_at + step, start_ticks=me.process_start_ticks)
    _, action, _ = held(company, receipt=receipt)
    assert owner_hold_verdict(action).kind == "same_host_alive"


def test_same_host_name_under_another_kernel_boot_is_not_called_alive(company) -> None:
    # This very PID and start time: alive here, but after a reboot it is someone else's.
    receipt = receipt_for(pid=os.getpid(), kernel_boot_id=str(uuid.uuid4()))
    _, action, _ = held(company, receipt=receipt)
    verdict = owner_hold_verdict(action)
    assert verdict.kind == "other_boot"
    assert f"another kernel boot ({receipt['kernelBootId']}" in verdict.headline
    assert verdict.confirmable


def test_same_host_alive_without_kernel_boot_id(company) -> None:
    _, action, _ = held(company, receipt=receipt_for(pid=os.getpid(), legacy=True))
    assert owner_hold_verdict(action).kind == "same_host_alive"


def test_same_host_dead_without_barrier(company) -> None:
    _, action, _ = held(company, receipt=receipt_for(pid=exited_pid()))
    verdict = owner_hold_verdict(action)
    assert verdict.kind == "same_host_dead_no_barrier"
    assert "no succeeded copy-back barrier" in verdict.headline
    assert any("copy-back process" in check for check in verdict.checks)


def test_same_host_dead_with_barrier(company) -> None:
    b, action, _ = held(company, receipt=receipt_for(pid=exited_pid()))
    WorkspaceOperation.objects.create(
        company=company,
        heartbeat_run=b.run,
        issue=b.issue,
        execution_workspace=b.workspace,
        phase=Op.PHASE_WORKSPACE_FINALIZE,
        status=Op.Status.SUCCEEDED,
    )
    assert owner_hold_verdict(action).kind == "same_host_dead_with_barrier"


def test_platform_proof_pending_then_proved(company) -> None:
    receipt = receipt_for(hostname="pod-7.example", worker={"id": "worker-7", "kind": "k8s"})
    b, action, _ = held(company, receipt=receipt)
    verdict = owner_hold_verdict(action)
    assert verdict.kind == "platform_proof_pending"
    assert "worker-7" in verdict.headline
    WorkerStopReceipt.objects.create(
        company=company,
        run=b.run,
        owner_token=receipt["token"],
        worker_id="worker-7",
        stopped_at="2026-01-01T00:00:00Z",
        signature="sig",
    )
    assert owner_hold_verdict(action).kind == "foreign_host"


def test_unreadable_receipt_and_changed_owner(company) -> None:
    b, action, _receipt = held(company, receipt={"token": "t", "hostname": "h"})
    assert owner_hold_verdict(action).kind == "receipt_unreadable"
    b.run.runner_profile_json = {"nativeWorkspaceFinalizationOwner": {"token": "newer"}}
    b.run.save(update_fields=["runner_profile_json"])
    assert owner_hold_verdict(action).kind == "owner_changed"


def test_confirmed_hold(company) -> None:
    _, action, _receipt = held(company)
    action.evidence = {**action.evidence, "workspaceOwnerStop": {"confirmedAt": "now"}}
    assert owner_hold_verdict(action).kind == "confirmed"
