"""HTTP API: results, finalize, recovery actions, owner-stop confirmation, worker stops."""

from __future__ import annotations

from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.test import override_settings

from paperclip.models import ActivityEvent, HeartbeatRun, WorkspaceOperation
from paperclip.receipts import OWNER_KEY, STOP_PROOF_KEY
from paperclip.worker.jobs import pending_jobs
from recovery.adapters.copyback import copyback_discards_wait
from recovery.adapters.platform import worker_stop_signature
from recovery.locks import finalization_queueing_lock
from recovery.models import IssueRecoveryAction
from recovery.services import Acquired, with_finalization_ownership
from tests.helpers import assert_error, run_jobs
from tests.recovery.factories import make_binding, receipt_for

RESULT = {"result": {"summary": "done"}, "terminal": {"run_terminal_state": "succeeded"}}


@pytest.mark.django_db
def test_result_is_accepted_once_and_idempotent_on_caller_id(make_agent_client: Any) -> None:
    b = make_binding(phase="observed", with_result=False)
    client = make_agent_client(b.agent)
    url = f"/api/heartbeat-runs/{b.run.pk}/results"
    first = client.post(url, {**RESULT, "caller_result_id": "r-1"}, format="json")
    assert first.status_code == 201, first.json()
    body = first.json()
    assert body["result_json"] == {
        "result": {"summary": "done"},
        "terminal": {"schema": "paperclip.prp.terminal.v1", "runTerminalState": "succeeded"},
    }
    again = client.post(url, {**RESULT, "caller_result_id": "r-1"}, format="json")
    assert again.status_code == 200
    assert again.json()["id"] == body["id"]
    clash = client.post(
        url,
        {
            "result": {"other": 1},
            **{k: RESULT[k] for k in ("terminal",)},
            "caller_result_id": "r-1",
        },
        format="json",
    )
    assert clash.status_code == 409
    b.refresh()
    assert (b.coordinator.phase, str(b.coordinator.result_id)) == ("result_accepted", body["id"])
    assert b.run.native_phase == "result_accepted"
    assert ActivityEvent.objects.filter(action="run.native_result_accepted").count() == 1


@pytest.mark.django_db
def test_result_input_errors_and_other_agents(make_agent_client: Any) -> None:
    b = make_binding(phase="observed", with_result=False)
    url = f"/api/heartbeat-runs/{b.run.pk}/results"
    bad = make_agent_client(b.agent).post(
        url, {"result": {}, "terminal": {"run_terminal_state": "exploded"}}, format="json"
    )
    assert_error(bad, 400, "invalid_request")
    from tests.paperclip.factories import AgentFactory

    sibling = make_agent_client(AgentFactory(company=b.company))
    assert sibling.post(url, RESULT, format="json").status_code == 403
    stranger = make_agent_client(AgentFactory())
    assert stranger.post(url, RESULT, format="json").status_code == 404


@pytest.mark.django_db
def test_recovery_actions_list_board_and_assignee(
    make_agent_client: Any, make_board_client: Any
) -> None:
    b = make_binding()
    IssueRecoveryAction.objects.create(
        company=b.company,
        source_issue=b.issue,
        kind="active_run_watchdog",
        owner_type="board",
        cause="c",
        fingerprint="f",
        evidence={"runId": "x", "nested": {"camelCase": [1]}},
        next_action="n",
    )
    url = f"/api/issues/{b.issue.pk}/recovery-actions"
    board = make_board_client(b.company).get(url)
    assert board.status_code == 200
    [row] = board.json()["results"]
    assert row["evidence"] == {"runId": "x", "nested": {"camelCase": [1]}}
    assert set(row) >= {
        "id",
        "kind",
        "status",
        "owner_type",
        "cause",
        "fingerprint",
        "next_action",
        "attempt_count",
        "max_attempts",
        "created_at",
        "updated_at",
    }
    assert make_agent_client(b.agent).get(url).status_code == 200
    from tests.paperclip.factories import AgentFactory

    assert make_agent_client(AgentFactory(company=b.company)).get(url).status_code == 403
    assert make_board_client().get(url).status_code == 404


@pytest.mark.django_db
def test_owner_stop_endpoint_is_board_only_and_validates(
    make_agent_client: Any, make_board_client: Any
) -> None:
    b = make_binding()
    url = f"/api/issues/{b.issue.pk}/recovery-actions/resume-workspace-finalization"
    body = {
        "action_id": str(b.run.pk),
        "run_id": str(b.run.pk),
        "owner_token": "t",
        "controller_and_copyback_stopped": True,
        "stop_evidence": "x" * 25,
    }
    assert make_agent_client(b.agent).post(url, body, format="json").status_code == 403
    board = make_board_client(b.company)
    missing = board.post(url, {**body, "controller_and_copyback_stopped": False}, format="json")
    assert missing.status_code == 400
    assert "controller_and_copyback_stopped" in missing.json()["error"]["details"]["fields"]
    short = board.post(url, {**body, "stop_evidence": " a b c "}, format="json")
    assert short.status_code == 400
    stale = board.post(url, body, format="json")
    assert_error(stale, 409, "workspace_owner_recovery_stale")


@pytest.mark.django_db(transaction=True)
def test_held_finalization_confirmed_by_the_board_then_reconciled(
    tmp_path: Path, make_board_client: Any, make_agent_client: Any
) -> None:
    prior = receipt_for(hostname="lost-node.example")
    b = make_binding(tmp_path=tmp_path, receipt=prior)
    agent = make_agent_client(b.agent)

    queued = agent.post(f"/api/heartbeat-runs/{b.run.pk}/finalize")
    assert queued.status_code == 202, queued.json()
    assert queued.json()["status"] == "queued"
    run_jobs()
    held = agent.get(f"/api/heartbeat-runs/{b.run.pk}").json()["finalization"]
    assert (held["state"], held["reason"]) == ("held", "owner_unverified")
    board = make_board_client(b.company)
    [action] = board.get(f"/api/issues/{b.issue.pk}/recovery-actions").json()["results"]
    assert action["evidence"]["owner"] == prior

    confirm = board.post(
        f"/api/issues/{b.issue.pk}/recovery-actions/resume-workspace-finalization",
        {
            "action_id": action["id"],
            "run_id": str(b.run.pk),
            "owner_token": prior["token"],
            "controller_and_copyback_stopped": True,
            "stop_evidence": "node lost-node drained and deleted by the autoscaler at 12:03Z",
        },
        format="json",
    )
    assert confirm.status_code == 202, confirm.json()
    assert confirm.json() == {
        "run_id": str(b.run.pk),
        "result_id": str(b.result.pk),
        "status": "queued",
    }

    # The confirmation deferred the job itself: the worker commits with no other call.
    run_jobs()
    assert (b.dest_dir / "README.md").read_text() == "hello\n"
    assert (b.dest_dir / "src" / "main.py").read_text() == "print('hi')\n"
    b.refresh()
    assert b.coordinator.phase == "committed"
    assert b.run.native_phase == "committed"
    assert b.run.result_json["finalizationPhase"] == "committed"
    assert b.run.status == "succeeded"
    assert (b.issue.execution_run_id, b.issue.checkout_run_id) == (None, None)
    assert OWNER_KEY not in b.run.runner_profile_json
    op = WorkspaceOperation.objects.get(heartbeat_run=b.run, phase="workspace_finalize")
    assert op.status == "succeeded"
    assert op.finished_at is not None
    resolved = IssueRecoveryAction.objects.get(pk=action["id"])
    assert (resolved.status, resolved.outcome) == ("resolved", "restored")
    board = make_board_client(b.company)
    audit_rows = ActivityEvent.objects.count()
    again = board.post(f"/api/heartbeat-runs/{b.run.pk}/finalize")
    assert again.status_code == 200
    assert again.json()["status"] == "committed"
    assert again.json()["finalization"]["state"] == "committed"
    assert ActivityEvent.objects.count() == audit_rows  # a repeat on a committed run writes nothing


@pytest.mark.django_db(transaction=True)
def test_finalize_on_a_large_workspace_is_answered_without_copying_anything(
    tmp_path: Path, make_agent_client: Any
) -> None:
    """The request only queues the work: with 20,000 files and no worker running, it answers
    202 with nothing copied and no copy-back started (its latency is in bench/finalize.py)."""
    b = make_binding(tmp_path=tmp_path)
    for index in range(20_000):
        (b.source_dir / f"f{index % 100}").mkdir(exist_ok=True)
        (b.source_dir / f"f{index % 100}" / f"{index}.txt").write_text("x")
    res = make_agent_client(b.agent).post(f"/api/heartbeat-runs/{b.run.pk}/finalize")
    assert res.status_code == 202, res.json()
    assert res.json()["status"] == "queued"
    assert res.json()["finalization"]["state"] == "queued"
    assert not WorkspaceOperation.objects.filter(heartbeat_run=b.run).exists()
    assert not b.dest_dir.exists()
    [job] = pending_jobs(finalization_queueing_lock(b.run.pk))
    assert job.args["explicit"] is True
    # A repeat finds that job waiting: the same answer, nothing written.
    again = make_agent_client(b.agent)
    audit_rows = ActivityEvent.objects.count()
    assert again.post(f"/api/heartbeat-runs/{b.run.pk}/finalize").status_code == 202
    assert ActivityEvent.objects.count() == audit_rows
    assert [j.id for j in pending_jobs(finalization_queueing_lock(b.run.pk))] == [job.id]


@pytest.mark.django_db
def test_finalize_rejects_a_bad_wait_and_a_run_without_result(make_agent_client: Any) -> None:
    b = make_binding(with_result=False)
    client = make_agent_client(b.agent)
    for bad in ("31", "-1", "1.5", "x", "1e1"):
        error = assert_error(
            client.post(f"/api/heartbeat-runs/{b.run.pk}/finalize?wait={bad}"),
            400,
            "invalid_request",
        )
        assert "wait" in error["details"]["fields"]
    assert_error(
        client.post(f"/api/heartbeat-runs/{b.run.pk}/finalize"), 409, "finalization_not_ready"
    )


@pytest.mark.django_db(transaction=True)
def test_finalize_endpoint_copies_and_commits(tmp_path: Path, make_agent_client: Any) -> None:
    b = make_binding(tmp_path=tmp_path)
    b.dest_dir.mkdir(parents=True)
    (b.dest_dir / "stale.txt").write_text("old")
    (b.source_dir / "escape").symlink_to("/etc/passwd")
    (b.source_dir / "inner").symlink_to("README.md")
    res = make_agent_client(b.agent).post(f"/api/heartbeat-runs/{b.run.pk}/finalize")
    assert res.status_code == 202, res.json()
    run_jobs()
    state = make_agent_client(b.agent).get(f"/api/heartbeat-runs/{b.run.pk}").json()
    assert state["finalization"]["state"] == "committed"
    op = WorkspaceOperation.objects.get(heartbeat_run=b.run, phase="workspace_finalize")
    assert op.metadata["copied"]["files"] == 2
    assert op.metadata["copied"]["skipped"] == ["escape"]
    assert not (b.dest_dir / "stale.txt").exists()
    assert not (b.dest_dir / "escape").exists()
    assert (b.dest_dir / "inner").is_symlink()
    copyback_discards_wait()  # the replaced tree is deleted beside the commit
    assert sorted(p.name for p in b.dest_dir.parent.iterdir()) == ["repo"]  # no leftovers


@pytest.mark.django_db(transaction=True)
def test_copyback_failure_keeps_the_result_and_schedules_a_retry(
    tmp_path: Path, make_agent_client: Any
) -> None:
    b = make_binding(tmp_path=tmp_path)
    import shutil

    shutil.rmtree(b.source_dir)
    res = make_agent_client(b.agent).post(f"/api/heartbeat-runs/{b.run.pk}/finalize")
    assert res.status_code == 202
    run_jobs()
    state = make_agent_client(b.agent).get(f"/api/heartbeat-runs/{b.run.pk}").json()
    assert state["finalization"]["state"] == "retry_scheduled"
    assert state["finalization"]["attempts"] == 1
    assert state["finalization"]["last_error"].startswith("workspace_copyback_failed")
    b.refresh()
    assert b.coordinator.phase == "workspace_finalizing"
    assert b.coordinator.next_attempt_at is not None
    assert b.run.status == "running"
    assert WorkspaceOperation.objects.get(heartbeat_run=b.run).status == "failed"
    # The owner deferred the retry as it let go, at the back-off time (database clock).
    [retry] = pending_jobs(finalization_queueing_lock(b.run.pk))
    assert retry.scheduled_at == b.coordinator.next_attempt_at
    out = StringIO()
    call_command("reconcile_finalizations", stdout=out)  # not due yet: nothing examined
    assert "examined 0" in out.getvalue()


@pytest.mark.django_db(transaction=True)
@override_settings(PAPERCLIP_PLATFORM_STOP_SECRET="s3cret-for-tests")
def test_signed_worker_stop_receipt_lets_a_controller_take_over(tmp_path: Path) -> None:
    from rest_framework.test import APIClient

    prior = receipt_for(hostname="pod-1.cluster", worker={"id": "pod-1", "platform": "k8s"})
    b = make_binding(receipt=prior)
    pending = with_finalization_ownership(
        company_id=b.company.pk, run_id=b.run.pk, action=lambda o: 1
    )
    assert pending.reason == "platform_stop_pending"  # type: ignore[union-attr]
    fields = {
        "run_id": str(b.run.pk),
        "owner_token": prior["token"],
        "worker_id": "pod-1",
        "stopped_at": "2026-11-29T12:00:00+00:00",
    }
    bad = APIClient().post(
        "/api/platform/worker-stops", {**fields, "signature": "0" * 64}, format="json"
    )
    assert bad.status_code == 422
    sig = worker_stop_signature(
        secret="s3cret-for-tests",
        run_id=b.run.pk,
        owner_token=prior["token"],
        worker_id="pod-1",
        stopped_at=fields["stopped_at"],
    )
    ok = APIClient().post("/api/platform/worker-stops", {**fields, "signature": sig}, format="json")
    assert ok.status_code == 201, ok.json()

    outcome = with_finalization_ownership(
        company_id=b.company.pk, run_id=b.run.pk, action=lambda o: "resumed"
    )

    assert outcome == Acquired("resumed")
    b.run.refresh_from_db()
    assert b.run.runner_profile_json[STOP_PROOF_KEY]["workerId"] == "pod-1"
    assert ActivityEvent.objects.filter(action="issue.workspace_owner_stop_verified").exists()
    hold = IssueRecoveryAction.objects.get(source_issue=b.issue)
    assert hold.evidence["workspaceOwnerRecovery"] == {"state": "resuming"}


@pytest.mark.django_db(transaction=True)
def test_finalize_run_command(tmp_path: Path) -> None:
    b = make_binding(tmp_path=tmp_path)
    out = StringIO()
    call_command("finalize_run", str(b.run.pk), stdout=out)
    assert "committed" in out.getvalue()
    assert HeartbeatRun.objects.get(pk=b.run.pk).status == "succeeded"


@pytest.mark.django_db(transaction=True)
def test_commit_ends_the_run_through_the_core_lifecycle(
    tmp_path: Path, make_agent_client: Any
) -> None:
    """Finalization ends the run with the same lifecycle step as a status PATCH: the issue's
    execution and checkout slots are freed and a `heartbeat_run.status_changed` row records it."""
    b = make_binding(tmp_path=tmp_path)
    b.refresh()
    assert b.issue.execution_run_id == b.run.pk  # the run holds its issue
    res = make_agent_client(b.agent).post(f"/api/heartbeat-runs/{b.run.pk}/finalize")
    assert res.status_code == 202, res.json()
    run_jobs()
    b.refresh()
    assert (b.run.status, b.issue.execution_run_id, b.issue.checkout_run_id) == (
        "succeeded",
        None,
        None,
    )
    changed = ActivityEvent.objects.get(
        action="heartbeat_run.status_changed", entity_id=str(b.run.pk)
    )
    assert changed.details["via"] == "finalization"
    assert (changed.details["from"], changed.details["to"]) == ("running", "succeeded")
    committed = ActivityEvent.objects.get(action="run.finalization_committed")
    assert committed.details["issueLockCleared"] is True
