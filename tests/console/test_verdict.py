"""The held finalization's verdict, in words: one case per kind of recorded owner."""

from __future__ import annotations

import os
import uuid
from datetime import timedelta

import pytest

from paperclip.models import WorkspaceOperation
from paperclip.models import WorkspaceOperation as Op
from recovery.adapters.identity import TakeoverDecision, current_controller_identity
from recovery.models import WorkerStopReceipt
from recovery.selectors.verdict import RULE_VERDICT, owner_hold_verdict
from recovery.services.ownership import memory
from recovery.takeover import RecordedOwner, takeover_ruling
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
    # The rule takes over on the platform's proof, whatever the host: so does the page.
    proved = owner_hold_verdict(action)
    assert proved.kind == "platform_proved"
    assert proved.confirmable


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


# --- The page and the rule agree ----------------------------------------------------------------
HOSTS = ("this_host", "other_host", "other_boot")
OWNERS = ("alive", "dead", "self_live", "self_joined")
WORKERS = (None, "pending", "proved")


@pytest.mark.parametrize("barrier", [False, True])
@pytest.mark.parametrize("worker", WORKERS)
@pytest.mark.parametrize("owner", OWNERS)
@pytest.mark.parametrize("host", HOSTS)
def test_the_verdict_and_the_takeover_rule_agree_on_every_evidence(
    company, host: str, owner: str, worker: str | None, barrier: bool
) -> None:
    """Each combination of evidence built in the database and the process table; the page's
    verdict must stand for the ruling the rule gives on the same facts as plain values."""
    me = current_controller_identity()
    this_process = owner.startswith("self")
    receipt = receipt_for(
        hostname=me.hostname if host != "other_host" else "elsewhere.example",
        kernel_boot_id=str(uuid.uuid4()) if host == "other_boot" else None,
        pid=exited_pid() if owner == "dead" else os.getpid(),
        boot_id=me.boot_id if this_process else None,
        worker={"id": "worker-7", "kind": "k8s"} if worker else None,
    )
    b, action, _ = held(company, receipt=receipt)
    if barrier:
        WorkspaceOperation.objects.create(
            company=company,
            heartbeat_run=b.run,
            issue=b.issue,
            execution_workspace=b.workspace,
            phase=Op.PHASE_WORKSPACE_FINALIZE,
            status=Op.Status.SUCCEEDED,
        )
    if worker == "proved":
        WorkerStopReceipt.objects.create(
            company=company,
            run=b.run,
            owner_token=receipt["token"],
            worker_id="worker-7",
            stopped_at="2026-01-01T00:00:00Z",
            signature="sig",
        )
    remembered = {
        "self_live": memory.active_owner_tokens,
        "self_joined": memory.joined_owner_tokens,
    }
    try:
        if owner in remembered:
            with memory.memory_lock:
                remembered[owner].add(receipt["token"])
        verdict = owner_hold_verdict(action)
    finally:
        with memory.memory_lock:
            memory.active_owner_tokens.discard(receipt["token"])
            memory.joined_owner_tokens.discard(receipt["token"])

    same_host = host == "this_host"
    facts = RecordedOwner(
        readable=True,
        same_host=same_host,
        same_process=same_host and this_process,
        live_here=owner == "self_live",
        joined_here=owner == "self_joined",
    )
    ruling = takeover_ruling(
        facts,
        stop_proof=lambda: worker == "proved",
        process=lambda: TakeoverDecision(owner == "dead", "probed"),
        copyback_barrier=lambda: barrier,
    )
    assert RULE_VERDICT[verdict.kind] == ruling.verdict, (verdict.kind, ruling)
