"""Orphaned runs (docs/leases.md#orphaned-runs): a running run every lease of which lapsed on
the database clock, with no accepted result. Shown in the Run JSON and on the dashboard and
in /metrics, interrupted by the worker after the grace (releasing its issue), or by the board
at once."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.test import override_settings

from leases.orphans import orphaned_runs, orphaned_runs_interrupt
from paperclip.models import ActivityEvent, HeartbeatRun, Issue, NativeRunFinalization
from tests.leases.factories import expire, running_run
from tests.paperclip.factories import (
    CompanyFactory,
    NativeRunFactory,
    NativeRunResultFactory,
)

pytestmark = pytest.mark.django_db


def _running() -> tuple[HeartbeatRun, Any]:
    run, _claim = running_run()
    return run, run.execution_workspace


def _age(run: HeartbeatRun, workspace: Any, seconds: int) -> None:
    """Its lease lapsed `seconds` ago, and it started before that (no sleeping)."""
    expire(workspace, seconds_ago=seconds)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE heartbeat_runs SET started_at = now() - make_interval(secs => %s)"
            " WHERE id = %s",
            [seconds + 60, run.pk],
        )


def test_a_run_with_a_live_lease_is_not_orphaned_a_lapsed_one_is() -> None:
    run, workspace = _running()
    assert orphaned_runs(run_ids=[run.pk]) == []
    _age(run, workspace, 30)
    (orphan,) = orphaned_runs(run_ids=[run.pk])
    assert orphan.since is not None
    # A live controller lease keeps it alive too.
    NativeRunFinalization.objects.create(
        run=run,
        company=run.company,
        issue=run.issue,
        lease_owner="boot:1",
        lease_expires_at="2999-01-01T00:00:00Z",
    )
    assert orphaned_runs(run_ids=[run.pk]) == []


def test_a_run_with_an_accepted_result_is_finalizations_not_an_orphan() -> None:
    run, workspace = _running()
    _age(run, workspace, 30)
    coordinator = NativeRunFinalization.objects.create(
        run=run, company=run.company, issue=run.issue, phase="observed"
    )
    assert orphaned_runs(run_ids=[run.pk]) != []  # a coordinator alone keeps nothing alive
    coordinator.result = NativeRunResultFactory(run=run)
    coordinator.phase = "result_accepted"
    coordinator.save(update_fields=["result", "phase"])
    assert orphaned_runs(run_ids=[run.pk]) == []


def test_the_run_json_shows_since_when(make_board_client: Any) -> None:
    run, workspace = _running()
    board = make_board_client(run.company)
    assert board.get(f"/api/heartbeat-runs/{run.pk}").json()["orphaned_since"] is None
    live = board.get(f"/api/heartbeat-runs/{run.pk}").json()["liveness"]
    assert live["last_renewed_at"] is not None
    assert live["orphaned_at"] > live["last_renewed_at"]  # its lease's expiry, still ahead
    _age(run, workspace, 30)
    body = board.get(f"/api/heartbeat-runs/{run.pk}").json()
    assert body["orphaned_since"] is not None
    assert body["liveness"]["orphaned_at"] == body["orphaned_since"]
    run.status = "failed"
    run.save(update_fields=["status"])
    assert board.get(f"/api/heartbeat-runs/{run.pk}").json()["liveness"] is None


@override_settings(PAPERCLIP_ORPHANED_RUN_GRACE_SECONDS=600)
def test_the_sweep_interrupts_runs_orphaned_past_the_grace_and_frees_their_issue() -> None:
    young, young_ws = _running()
    _age(young, young_ws, 60)  # orphaned, within the grace
    old, old_ws = _running()
    _age(old, old_ws, 3600)
    sweep = orphaned_runs_interrupt(grace_seconds=600)
    assert (sweep.examined, sweep.interrupted) == (1, 1)
    old.refresh_from_db()
    young.refresh_from_db()
    assert old.status == "interrupted"
    assert young.status == "running"
    issue = Issue.objects.get(pk=old.issue_id)
    assert issue.execution_run_id is None
    row = ActivityEvent.objects.get(action="heartbeat_run.status_changed", entity_id=str(old.pk))
    assert row.details["reason"] == "orphaned"
    assert row.actor_id == "orphaned_run_sweep"
    assert orphaned_runs_interrupt(grace_seconds=600).examined == 0  # nothing left


def test_the_board_interrupts_a_run_at_once_and_agents_cannot(
    make_board_client: Any, make_agent_client: Any
) -> None:
    run, _ws = _running()
    url = f"/api/heartbeat-runs/{run.pk}/interrupt"
    agent = make_agent_client(run.agent).post(url, {"reason": "gone"}, format="json")
    assert agent.status_code == 403
    board = make_board_client(run.company)
    assert board.post(url, {}, format="json").status_code == 400
    assert board.post(url, {"reason": ""}, format="json").status_code == 400
    writes = ActivityEvent.objects.count()
    done = board.post(url, {"reason": "the agent's VM was deleted"}, format="json")
    assert done.status_code == 200, done.content
    assert done.json()["status"] == "interrupted"
    assert ActivityEvent.objects.count() == writes + 1
    again = board.post(url, {"reason": "twice"}, format="json")
    assert again.status_code == 422
    assert again.json()["error"]["code"] == "invalid_run_transition"
    outsider = make_board_client(CompanyFactory())
    assert outsider.post(url, {"reason": "not mine"}, format="json").status_code == 404


def test_the_dashboard_and_metrics_count_orphaned_runs(
    superuser_client: Any, settings: Any
) -> None:
    run, workspace = _running()
    _age(run, workspace, 30)
    page = superuser_client.get("/admin/")
    assert b"Orphaned runs" in page.content
    listed = superuser_client.get("/admin/paperclip/heartbeatrun/?orphaned=yes")
    assert listed.status_code == 200
    assert str(run.pk).encode() in listed.content
    settings.PAPERCLIP_METRICS_ENABLED = True
    settings.PAPERCLIP_METRICS_TOKEN = ""
    metrics = superuser_client.get("/metrics").content.decode()
    assert "paperclip_orphaned_runs 1.0" in metrics


def test_a_start_meeting_an_orphaned_holder_interrupts_it_and_takes_the_issue(
    make_agent_client: Any,
) -> None:
    holder, workspace = _running()
    successor = NativeRunFactory(
        company=holder.company,
        agent=holder.agent,
        issue=holder.issue,
        native_issue=holder.issue,
        execution_workspace=workspace,
        status="queued",
    )
    client = make_agent_client(holder.agent)
    url = f"/api/heartbeat-runs/{successor.pk}"
    # While the holder's lease is live: 409 naming it, its agent, its last renewal and when
    # it would count as orphaned.
    refused = client.patch(url, {"status": "running"}, format="json")
    assert refused.status_code == 409
    details = refused.json()["error"]["details"]
    assert details["holder_run_id"] == str(holder.pk)
    assert details["holder_agent_id"] == str(holder.agent_id)
    assert details["last_renewed_at"] is not None
    assert details["orphaned_at"] is not None
    # Its agent died: the lease lapsed. The start interrupts it and goes on, in one transaction.
    _age(holder, workspace, 30)
    started = client.patch(url, {"status": "running"}, format="json")
    assert started.status_code == 200, started.content
    holder.refresh_from_db()
    assert holder.status == "interrupted"
    assert Issue.objects.get(pk=holder.issue_id).execution_run_id == successor.pk
    row = ActivityEvent.objects.get(action="heartbeat_run.status_changed", entity_id=str(holder.pk))
    assert row.details["reason"] == "orphaned"
