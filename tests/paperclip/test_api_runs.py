"""Core API: heartbeat runs, their lifecycle and the issue execution lock."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from rest_framework.test import APIClient

from paperclip.models import (
    ActivityEvent,
    Agent,
    Company,
    HeartbeatRun,
    Issue,
    NativeRunFinalization,
)
from tests.helpers import assert_error
from tests.paperclip.factories import (
    AgentFactory,
    ExecutionWorkspaceFactory,
    HeartbeatRunFactory,
    IssueFactory,
    NativeRunFactory,
    NativeRunFinalizationFactory,
    NativeRunResultFactory,
)
from tests.paperclip.helpers import audit_count

pytestmark = pytest.mark.django_db

TERMINAL = ["succeeded", "failed", "cancelled", "timed_out", "interrupted"]
ALL = ["queued", "running", *TERMINAL]


def _create(client: APIClient, **body: Any) -> Any:
    return client.post("/api/heartbeat-runs", body, format="json")


# --- creation ---------------------------------------------------------------------------------


def test_agent_creates_a_native_run_with_its_coordinator(
    agent_client: APIClient, agent: Agent, company: Company
) -> None:
    issue = IssueFactory(company=company)
    workspace = ExecutionWorkspaceFactory(company=company)
    response = _create(
        agent_client,
        runtime_mode="native",
        issue_id=str(issue.pk),
        execution_workspace_id=str(workspace.pk),
        workspace_dir="/srv/runs/abc",
    )
    assert response.status_code == 201, response.content
    body = response.json()
    assert {
        k: body[k] for k in ("company_id", "agent_id", "issue_id", "status", "runtime_mode")
    } == {
        "company_id": str(company.pk),
        "agent_id": str(agent.pk),
        "issue_id": str(issue.pk),
        "status": "queued",
        "runtime_mode": "native",
    }
    assert body["execution_workspace_id"] == str(workspace.pk)
    assert body["finalization_owner"] is None
    assert body["native_phase"] is None
    assert body["created_at"]
    run = HeartbeatRun.objects.get(pk=body["id"])
    assert run.native_issue_id == issue.pk
    assert run.completion_contract_id is not None
    assert run.context_snapshot == {
        "issueId": str(issue.pk),
        "executionWorkspaceId": str(workspace.pk),
    }
    assert run.runner_profile_json == {
        "nativeExecutionInput": {"binding": {"workspaceDir": "/srv/runs/abc"}}
    }
    coordinator = NativeRunFinalization.objects.get(run=run)
    assert (coordinator.phase, coordinator.issue_id, coordinator.company_id) == (
        "observed",
        issue.pk,
        company.pk,
    )
    event = ActivityEvent.objects.get(action="heartbeat_run.created")
    assert (event.run_id, event.actor_type, event.actor_id) == (run.pk, "agent", str(agent.pk))


def test_legacy_run_without_issue(agent_client: APIClient) -> None:
    response = _create(agent_client, runtime_mode="legacy")
    assert response.status_code == 201
    run = HeartbeatRun.objects.get(pk=response.json()["id"])
    assert run.issue_id is None
    assert run.native_issue_id is None
    assert run.completion_contract_id is None
    assert not NativeRunFinalization.objects.exists()


def test_legacy_run_with_issue_binds_issue_only(agent_client: APIClient, company: Company) -> None:
    issue = IssueFactory(company=company)
    run = HeartbeatRun.objects.get(
        pk=_create(agent_client, runtime_mode="legacy", issue_id=str(issue.pk)).json()["id"]
    )
    assert run.issue_id == issue.pk
    assert run.native_issue_id is None


def test_board_creates_a_run_for_an_agent(board_client: APIClient, agent: Agent) -> None:
    response = _create(board_client, runtime_mode="legacy", agent_id=str(agent.pk))
    assert response.status_code == 201
    assert response.json()["agent_id"] == str(agent.pk)
    assert ActivityEvent.objects.get(action="heartbeat_run.created").actor_type == "user"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "runtime_mode"),
        ({"runtime_mode": "turbo"}, "runtime_mode"),
        ({"runtime_mode": "native"}, "issue_id"),
        ({"runtime_mode": "native", "issue_id": None}, "issue_id"),
        ({"runtime_mode": "legacy", "issue_id": "nope"}, "issue_id"),
        ({"runtime_mode": "legacy", "execution_workspace_id": 4}, "execution_workspace_id"),
        ({"runtime_mode": "legacy", "workspace_dir": "rel/dir"}, "workspace_dir"),
        ({"runtime_mode": "legacy", "workspace_dir": "/a/../b"}, "workspace_dir"),
        ({"runtime_mode": "legacy", "status": "running"}, "status"),
    ],
)
def test_run_create_validates_fields(
    agent_client: APIClient, body: dict[str, Any], field: str
) -> None:
    before = audit_count()
    response = agent_client.post("/api/heartbeat-runs", body, format="json")
    assert field in assert_error(response, 400, "invalid_request")["details"]["fields"]
    assert not HeartbeatRun.objects.exists()
    assert audit_count() == before


def test_board_must_name_the_agent(board_client: APIClient) -> None:
    response = _create(board_client, runtime_mode="legacy")
    assert "agent_id" in assert_error(response, 400, "invalid_request")["details"]["fields"]


def test_agent_cannot_create_runs_for_another_agent(
    agent_client: APIClient, company: Company
) -> None:
    other = AgentFactory(company=company)
    assert_error(
        _create(agent_client, runtime_mode="legacy", agent_id=str(other.pk)),
        403,
        "permission_denied",
    )
    assert not HeartbeatRun.objects.exists()


def test_agent_may_name_itself(agent_client: APIClient, agent: Agent) -> None:
    assert _create(agent_client, runtime_mode="legacy", agent_id=str(agent.pk)).status_code == 201


def test_related_rows_must_be_in_the_agents_company(
    agent_client: APIClient, other_company: Company
) -> None:
    foreign_issue = IssueFactory(company=other_company)
    foreign_ws = ExecutionWorkspaceFactory(company=other_company)
    before = audit_count()
    for body in (
        {"runtime_mode": "native", "issue_id": str(foreign_issue.pk)},
        {"runtime_mode": "legacy", "execution_workspace_id": str(foreign_ws.pk)},
        {"runtime_mode": "legacy", "issue_id": str(uuid.uuid4())},
    ):
        assert_error(
            agent_client.post("/api/heartbeat-runs", body, format="json"), 404, "not_found"
        )
    assert not HeartbeatRun.objects.exists()
    assert not NativeRunFinalization.objects.exists()
    assert audit_count() == before


def test_board_member_of_both_companies_cannot_mix_them(
    make_board_client, company: Company, other_company: Company
) -> None:
    client = make_board_client(company, other_company)
    agent = AgentFactory(company=company)
    foreign_issue = IssueFactory(company=other_company)
    response = _create(
        client, runtime_mode="native", agent_id=str(agent.pk), issue_id=str(foreign_issue.pk)
    )
    assert_error(response, 404, "not_found")


def test_board_cannot_create_runs_for_another_companys_agent(
    board_client: APIClient, other_company: Company
) -> None:
    foreign = AgentFactory(company=other_company)
    assert_error(
        _create(board_client, runtime_mode="legacy", agent_id=str(foreign.pk)), 404, "not_found"
    )


def test_paused_agent_cannot_get_runs(board_client: APIClient, company: Company) -> None:
    paused = AgentFactory(company=company, status=Agent.Status.PAUSED)
    assert_error(
        _create(board_client, runtime_mode="legacy", agent_id=str(paused.pk)),
        422,
        "agent_not_active",
    )


# --- reading ----------------------------------------------------------------------------------


def test_run_read_with_finalization_owner(board_client: APIClient, company: Company) -> None:
    run = HeartbeatRunFactory(
        company=company,
        runner_profile_json={
            "nativeWorkspaceFinalizationOwner": {
                "token": "t-1",
                "hostname": "host-a",
                "pid": 4242,
                "processStartedAt": "2024-01-01T00:00:00.000Z",
                "controllerBootId": "ignored",
            }
        },
    )
    body = board_client.get(f"/api/heartbeat-runs/{run.pk}").json()
    assert body["finalization_owner"] == {
        "token": "t-1",
        "hostname": "host-a",
        "pid": 4242,
        "process_started_at": "2024-01-01T00:00:00.000Z",
    }


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (
            {"token": "t", "pid": "12"},
            {"token": "t", "hostname": None, "pid": None, "process_started_at": None},
        ),
        (
            {"pid": True, "hostname": 5},
            {"token": None, "hostname": None, "pid": None, "process_started_at": None},
        ),
        ("garbage", {"token": None, "hostname": None, "pid": None, "process_started_at": None}),
        ([1, 2], {"token": None, "hostname": None, "pid": None, "process_started_at": None}),
    ],
)
def test_malformed_owner_receipt_renders_without_error(
    board_client: APIClient, company: Company, raw: Any, expected: dict[str, Any]
) -> None:
    run = HeartbeatRunFactory(
        company=company, runner_profile_json={"nativeWorkspaceFinalizationOwner": raw}
    )
    response = board_client.get(f"/api/heartbeat-runs/{run.pk}")
    assert response.status_code == 200
    assert response.json()["finalization_owner"] == expected


@pytest.mark.parametrize("profile", [None, [], "x", {}])
def test_profile_without_owner_renders_null(
    board_client: APIClient, company: Company, profile: Any
) -> None:
    run = HeartbeatRunFactory(company=company, runner_profile_json=profile)
    assert board_client.get(f"/api/heartbeat-runs/{run.pk}").json()["finalization_owner"] is None


def test_company_agents_may_read_runs(agent_client: APIClient, company: Company) -> None:
    run = HeartbeatRunFactory(company=company)
    assert agent_client.get(f"/api/heartbeat-runs/{run.pk}").status_code == 200


# --- lifecycle --------------------------------------------------------------------------------


def _patch(client: APIClient, run: HeartbeatRun, status: str) -> Any:
    return client.patch(f"/api/heartbeat-runs/{run.pk}", {"status": status}, format="json")


def test_run_goes_queued_running_succeeded_and_moves_the_issue_lock(
    agent_client: APIClient, agent: Agent, company: Company
) -> None:
    issue = IssueFactory(company=company)
    run_id = _create(agent_client, runtime_mode="legacy", issue_id=str(issue.pk)).json()["id"]
    run = HeartbeatRun.objects.get(pk=run_id)

    running = _patch(agent_client, run, "running")
    assert running.status_code == 200
    assert running.json()["status"] == "running"
    assert running.json()["started_at"]
    issue.refresh_from_db()
    assert issue.execution_run_id == run.pk
    assert issue.checkout_run_id == run.pk
    assert issue.execution_locked_at is not None

    done = _patch(agent_client, run, "succeeded")
    assert done.json()["status"] == "succeeded"
    assert done.json()["finished_at"]
    issue.refresh_from_db()
    assert issue.execution_run_id is None
    assert issue.checkout_run_id is None
    assert issue.execution_locked_at is None
    events = list(
        ActivityEvent.objects.filter(action="heartbeat_run.status_changed")
        .order_by("created_at")
        .values_list("details", flat=True)
    )
    assert {"from": "queued", "to": "running"} in events
    assert {"from": "running", "to": "succeeded"} in events
    assert len(events) == 2


def test_same_status_is_idempotent_without_audit(agent_client: APIClient, company: Company) -> None:
    run = HeartbeatRunFactory(company=company, agent=Agent.objects.get(), status="running")
    before = audit_count()
    response = _patch(agent_client, run, "running")
    assert response.status_code == 200
    assert response.json()["status"] == "running"
    assert audit_count() == before


@pytest.mark.parametrize("terminal", TERMINAL)
@pytest.mark.parametrize("target", ALL)
def test_no_way_back_from_a_terminal_status(
    board_client: APIClient, company: Company, terminal: str, target: str
) -> None:
    run = HeartbeatRunFactory(company=company, status=terminal)
    before = audit_count()
    response = _patch(board_client, run, target)
    if target == terminal:
        assert response.status_code == 200
    else:
        error = assert_error(response, 422, "invalid_run_transition")
        assert error["details"] == {
            "run_id": str(run.pk),
            "from_status": terminal,
            "to_status": target,
        }
    run.refresh_from_db()
    assert run.status == terminal
    assert audit_count() == before


def test_queued_cannot_succeed_but_can_end_otherwise(
    board_client: APIClient, company: Company
) -> None:
    run = HeartbeatRunFactory(company=company, status="queued")
    assert_error(_patch(board_client, run, "succeeded"), 422, "invalid_run_transition")
    for status in ("failed", "cancelled", "timed_out", "interrupted"):
        queued = HeartbeatRunFactory(company=company, status="queued")
        assert _patch(board_client, queued, status).json()["status"] == status


def test_running_cannot_go_back_to_queued(board_client: APIClient, company: Company) -> None:
    run = HeartbeatRunFactory(company=company, status="running")
    assert_error(_patch(board_client, run, "queued"), 422, "invalid_run_transition")


def test_another_live_run_holds_the_issue(board_client: APIClient, company: Company) -> None:
    issue = IssueFactory(company=company)
    holder = HeartbeatRunFactory(company=company, issue=issue, status="running")
    Issue.objects.filter(pk=issue.pk).update(execution_run=holder, checkout_run=holder)
    contender = HeartbeatRunFactory(company=company, issue=issue, status="queued")
    before = audit_count()
    error = assert_error(_patch(board_client, contender, "running"), 409, "issue_execution_locked")
    assert error["details"]["holder_run_id"] == str(holder.pk)
    contender.refresh_from_db()
    issue.refresh_from_db()
    assert contender.status == "queued"
    assert issue.execution_run_id == holder.pk
    assert audit_count() == before

    # Once the holder ends, the contender can start.
    assert _patch(board_client, holder, "failed").status_code == 200
    assert _patch(board_client, contender, "running").status_code == 200
    issue.refresh_from_db()
    assert issue.execution_run_id == contender.pk


def test_a_queued_holder_also_blocks(board_client: APIClient, company: Company) -> None:
    issue = IssueFactory(company=company)
    holder = HeartbeatRunFactory(company=company, issue=issue, status="queued")
    Issue.objects.filter(pk=issue.pk).update(checkout_run=holder)
    contender = HeartbeatRunFactory(company=company, issue=issue, status="queued")
    assert_error(_patch(board_client, contender, "running"), 409, "issue_execution_locked")


def test_a_terminal_holder_is_replaced(board_client: APIClient, company: Company) -> None:
    issue = IssueFactory(company=company)
    stale = HeartbeatRunFactory(company=company, issue=issue, status="failed")
    Issue.objects.filter(pk=issue.pk).update(execution_run=stale, checkout_run=stale)
    run = HeartbeatRunFactory(company=company, issue=issue, status="queued")
    assert _patch(board_client, run, "running").status_code == 200
    issue.refresh_from_db()
    assert (issue.execution_run_id, issue.checkout_run_id) == (run.pk, run.pk)


def test_finishing_a_run_leaves_another_runs_lock_alone(
    board_client: APIClient, company: Company
) -> None:
    issue = IssueFactory(company=company)
    holder = HeartbeatRunFactory(company=company, issue=issue, status="running")
    Issue.objects.filter(pk=issue.pk).update(execution_run=holder, checkout_run=holder)
    bystander = HeartbeatRunFactory(company=company, issue=issue, status="queued")
    assert _patch(board_client, bystander, "cancelled").status_code == 200
    issue.refresh_from_db()
    assert issue.execution_run_id == holder.pk


def test_native_run_with_accepted_result_cannot_be_patched_to_any_terminal_status(
    agent_client: APIClient, agent: Agent, company: Company
) -> None:
    """Its work is saved: it reaches the status its result names through finalization only, so
    neither its agent nor a successor ends it meanwhile
    (docs/recovery.md#runs-whose-result-was-accepted). Other endings used to stay possible."""
    run = NativeRunFactory(company=company, agent=agent, status="running")
    result = NativeRunResultFactory(run=run)
    NativeRunFinalizationFactory(run=run, phase="result_accepted", result=result)
    before = audit_count()
    for status in ("succeeded", "interrupted", "failed"):
        error = assert_error(_patch(agent_client, run, status), 422, "invalid_run_transition")
        assert "finalization" in error["message"]
    run.refresh_from_db()
    assert run.status == "running"
    assert audit_count() == before


def test_accepted_result_without_coordinator_update_still_blocks(
    board_client: APIClient, company: Company
) -> None:
    run = NativeRunFactory(company=company, status="running")
    NativeRunFinalizationFactory(run=run)
    NativeRunResultFactory(run=run)
    assert_error(_patch(board_client, run, "succeeded"), 422, "invalid_run_transition")


def test_native_run_without_result_may_succeed(board_client: APIClient, company: Company) -> None:
    run = NativeRunFactory(company=company, status="running")
    NativeRunFinalizationFactory(run=run)
    assert _patch(board_client, run, "succeeded").status_code == 200


def test_another_agent_of_the_company_cannot_patch(
    make_agent_client, company: Company, agent: Agent
) -> None:
    run = HeartbeatRunFactory(company=company, agent=agent, status="queued")
    other = make_agent_client(AgentFactory(company=company))
    assert_error(_patch(other, run, "running"), 403, "permission_denied")
    run.refresh_from_db()
    assert run.status == "queued"


@pytest.mark.parametrize(
    "body", [{}, {"status": "done"}, {"status": None}, {"status": "running", "x": 1}]
)
def test_patch_validates_status(
    board_client: APIClient, company: Company, body: dict[str, Any]
) -> None:
    run = HeartbeatRunFactory(company=company, status="queued")
    response = board_client.patch(f"/api/heartbeat-runs/{run.pk}", body, format="json")
    assert_error(response, 400, "invalid_request")
    run.refresh_from_db()
    assert run.status == "queued"
