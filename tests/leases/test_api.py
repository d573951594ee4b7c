"""HTTP API of runtime leases and fenced operations: shapes, outcomes, every error path."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from leases.models import WorkspaceRuntimeLease
from paperclip.models import ActivityEvent, Issue, WorkspaceOperation
from tests.helpers import assert_error
from tests.leases.factories import expire, running_run
from tests.paperclip.factories import (
    AgentFactory,
    ExecutionWorkspaceFactory,
    HeartbeatRunFactory,
    IssueFactory,
)

pytestmark = pytest.mark.django_db

LEASE_KEYS = {
    "id",
    "company_id",
    "execution_workspace_id",
    "owner_key",
    "owner_issue_id",
    "owner_run_id",
    "owner_agent_id",
    "last_action",
    "generation",
    "fence",
    "claimed_at",
    "renewed_at",
    "expires_at",
    "metadata",
}


def url(workspace_id, suffix="runtime-lease/claim"):
    return f"/api/execution-workspaces/{workspace_id}/{suffix}"


def post(client, workspace_id, body, suffix="runtime-lease/claim"):
    return client.post(url(workspace_id, suffix), body, format="json")


# --- claim --------------------------------------------------------------------------------


def test_agent_claims_renews_and_reads_the_lease(agent_client, agent, workspace):
    issue = IssueFactory(company=workspace.company)
    run = HeartbeatRunFactory(company=workspace.company, agent=agent)

    created = post(
        agent_client,
        workspace.pk,
        {"action": "start", "issue_id": str(issue.pk), "run_id": str(run.pk), "ttl_seconds": 300},
    )
    renewed = post(agent_client, workspace.pk, {"action": "restart", "issue_id": str(issue.pk)})
    shown = agent_client.get(url(workspace.pk, "runtime-lease"))

    assert created.status_code == 200, created.json()
    body = created.json()
    assert body["outcome"] == "created"
    assert body["owner_key"] == f"issue:{issue.pk}"
    assert body["reclaimed_from"] is None
    assert set(body["lease"]) == LEASE_KEYS
    assert body["lease"]["generation"] == 1
    assert body["lease"]["owner_run_id"] == str(run.pk)
    assert body["lease"]["expires_at"].endswith("Z")
    assert renewed.status_code == 200
    assert renewed.json()["outcome"] == "renewed"
    assert renewed.json()["lease"]["generation"] == 1
    assert renewed.json()["lease"]["claimed_at"] == body["lease"]["claimed_at"]
    assert shown.status_code == 200
    assert shown.json() == {"lease": renewed.json()["lease"], "stale_reason": None}


def test_claim_without_ids_uses_the_calling_agent(agent_client, agent, workspace):
    response = post(agent_client, workspace.pk, {"action": "repair"})
    assert response.json()["owner_key"] == f"agent:{agent.pk}"


def test_conflict_body(agent_client, agent, make_agent_client, workspace):
    post(agent_client, workspace.pk, {"action": "start"})
    rival = AgentFactory(company=workspace.company)

    response = post(make_agent_client(rival), workspace.pk, {"action": "stop"})

    error = assert_error(response, 409, "workspace_runtime_lease_conflict")
    assert error["remediation"]
    assert error["message"]
    lease = WorkspaceRuntimeLease.objects.get()
    assert error["details"] == {
        "execution_workspace_id": str(workspace.pk),
        "requested_action": "stop",
        "requested_owner_key": f"agent:{rival.pk}",
        "owner_key": f"agent:{agent.pk}",
        "owner_issue_id": None,
        "owner_run_id": None,
        "owner_agent_id": str(agent.pk),
        "last_action": "start",
        "claimed_at": error["details"]["claimed_at"],
        "renewed_at": error["details"]["renewed_at"],
        "expires_at": error["details"]["expires_at"],
        "generation": 1,
    }
    shown = agent_client.get(url(workspace.pk, "runtime-lease")).json()["lease"]
    for key in ("claimed_at", "renewed_at", "expires_at"):
        assert error["details"][key] == shown[key]
    assert lease.generation == 1


def test_reclaim_response_names_the_stale_owner(agent_client, agent, make_agent_client, workspace):
    issue = IssueFactory(company=workspace.company)
    post(agent_client, workspace.pk, {"action": "start", "issue_id": str(issue.pk)})
    Issue.objects.filter(pk=issue.pk).update(status="done")

    rival = AgentFactory(company=workspace.company)
    response = post(make_agent_client(rival), workspace.pk, {"action": "start"})

    assert response.status_code == 200
    body = response.json()
    assert body["outcome"] == "reclaimed"
    assert body["reclaimed_from"] == {
        "owner_key": f"issue:{issue.pk}",
        "reason": "owner_issue_terminal",
    }
    assert body["lease"]["generation"] == 2
    assert body["lease"]["metadata"]["reclaimReason"] == "owner_issue_terminal"


def test_get_shows_the_live_stale_reason(agent_client, workspace):
    post(agent_client, workspace.pk, {"action": "start"})
    expire(workspace)
    response = agent_client.get(url(workspace.pk, "runtime-lease"))
    assert response.json()["stale_reason"] == "lease_expired"


def test_get_without_lease(board_client, workspace):
    response = board_client.get(url(workspace.pk, "runtime-lease"))
    assert response.status_code == 200
    assert response.json() == {"lease": None, "stale_reason": None}


def test_board_claim_is_bypassed(board_client, agent_client, workspace):
    post(agent_client, workspace.pk, {"action": "start"})
    response = post(board_client, workspace.pk, {"action": "stop"})
    assert response.status_code == 200
    assert response.json() == {
        "outcome": "bypassed",
        "owner_key": None,
        "lease": None,
        "reclaimed_from": None,
    }


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"action": "destroy"},
        {"action": "start", "ttl_seconds": 59},
        {"action": "start", "ttl_seconds": 86_401},
        {"action": "start", "ttl_seconds": "soon"},
        {"action": "start", "issue_id": "not-a-uuid"},
        {"action": "start", "run_id": 12},
        ["start"],
    ],
)
def test_malformed_claims_are_400_and_change_nothing(agent_client, workspace, body):
    response = post(agent_client, workspace.pk, body)
    error = assert_error(response, 400, "invalid_request")
    assert "fields" in error["details"]
    assert WorkspaceRuntimeLease.objects.count() == 0
    assert not ActivityEvent.objects.filter(action__startswith="runtime_lease").exists()


def test_invalid_json_is_400(agent_client, workspace):
    response = agent_client.post(url(workspace.pk), "{nope", content_type="application/json")
    assert_error(response, 400, "invalid_request")


def test_foreign_and_missing_workspaces_are_404(agent_client, board_client, other_company):
    foreign = ExecutionWorkspaceFactory(company=other_company)
    for client in (agent_client, board_client):
        for workspace_id in (foreign.pk, uuid.uuid4(), "not-a-uuid"):
            for suffix, method in (
                ("runtime-lease/claim", "post"),
                ("runtime-lease", "get"),
                ("runtime-lease/release", "post"),
            ):
                if method == "post":
                    body = {"action": "start"} if suffix.endswith("claim") else {}
                    response = post(client, workspace_id, body, suffix)
                else:
                    response = client.get(url(workspace_id, suffix))
                assert response.status_code == 404, (suffix, workspace_id)
                assert_error(response, 404, "not_found")
    assert WorkspaceRuntimeLease.objects.count() == 0


def test_foreign_issue_and_run_are_404_and_another_agents_run_is_403(
    agent_client, agent, workspace, other_company
):
    cases = [
        ({"issue_id": str(IssueFactory(company=other_company).pk)}, 404, "not_found"),
        ({"issue_id": str(uuid.uuid4())}, 404, "not_found"),
        ({"run_id": str(HeartbeatRunFactory(company=other_company).pk)}, 404, "not_found"),
        ({"run_id": str(uuid.uuid4())}, 404, "not_found"),
        (
            {"run_id": str(HeartbeatRunFactory(company=workspace.company).pk)},
            403,
            "permission_denied",
        ),
    ]
    for extra, http_status, code in cases:
        for suffix in ("runtime-lease/claim", "runtime-lease/release"):
            action = {"action": "start"} if suffix.endswith("claim") else {}
            response = post(agent_client, workspace.pk, {**action, **extra}, suffix)
            assert response.status_code == http_status, (extra, suffix, response.json())
            assert_error(response, http_status, code)
    assert WorkspaceRuntimeLease.objects.count() == 0


def test_unauthenticated_is_401(client, workspace):
    response = client.post(url(workspace.pk), {"action": "start"}, content_type="application/json")
    assert_error(response, 401, "not_authenticated")


# --- release ------------------------------------------------------------------------------


def test_agent_releases_only_its_own_lease(agent_client, agent, make_agent_client, workspace):
    issue = IssueFactory(company=workspace.company)
    post(agent_client, workspace.pk, {"action": "start", "issue_id": str(issue.pk)})
    rival_client = make_agent_client(AgentFactory(company=workspace.company))

    not_mine = post(rival_client, workspace.pk, {}, "runtime-lease/release")
    wrong_key = post(agent_client, workspace.pk, {}, "runtime-lease/release")  # agent:<id>
    mine = post(agent_client, workspace.pk, {"issue_id": str(issue.pk)}, "runtime-lease/release")
    again = post(agent_client, workspace.pk, {"issue_id": str(issue.pk)}, "runtime-lease/release")

    assert not_mine.json() == {"released": False, "owner_key": None}
    assert wrong_key.json() == {"released": False, "owner_key": None}
    assert mine.status_code == 200
    assert mine.json() == {"released": True, "owner_key": f"issue:{issue.pk}"}
    assert again.json() == {"released": False, "owner_key": None}
    assert WorkspaceRuntimeLease.objects.count() == 0
    assert ActivityEvent.objects.filter(action="runtime_lease.released").count() == 1


def test_agent_sending_force_gets_403(agent_client, workspace):
    post(agent_client, workspace.pk, {"action": "start"})
    for body in ({"force": True, "reason": "mine now"}, {"force": "yes"}):
        response = post(agent_client, workspace.pk, body, "runtime-lease/release")
        assert_error(response, 403, "permission_denied")
    assert WorkspaceRuntimeLease.objects.count() == 1


def test_board_force_release_requires_a_reason_and_is_audited(
    agent_client, board_client, workspace
):
    post(agent_client, workspace.pk, {"action": "start"})
    for body in ({"force": True}, {"force": True, "reason": "   "}):
        response = post(board_client, workspace.pk, body, "runtime-lease/release")
        assert response.status_code == 400
        assert "reason" in response.json()["error"]["details"]["fields"]
    assert WorkspaceRuntimeLease.objects.count() == 1

    response = post(
        board_client,
        workspace.pk,
        {"force": True, "reason": "agent wedged"},
        "runtime-lease/release",
    )

    assert response.status_code == 200
    assert response.json()["released"] is True
    assert WorkspaceRuntimeLease.objects.count() == 0
    event = ActivityEvent.objects.get(action="runtime_lease.force_released")
    assert event.actor_type == "user"
    assert event.actor_id == str(board_client.user.pk)
    assert event.details["reason"] == "agent wedged"
    again = post(
        board_client, workspace.pk, {"force": True, "reason": "twice"}, "runtime-lease/release"
    )
    assert again.json() == {"released": False, "owner_key": None}


def test_board_release_without_force_releases_nothing(agent_client, board_client, workspace):
    post(agent_client, workspace.pk, {"action": "start"})
    response = post(board_client, workspace.pk, {}, "runtime-lease/release")
    assert response.json() == {"released": False, "owner_key": None}
    assert WorkspaceRuntimeLease.objects.count() == 1


# --- fenced operations --------------------------------------------------------------------


def operation(client, workspace_id, **body):
    return post(
        client, workspace_id, {"phase": "runtime_start", "status": "running", **body}, "operations"
    )


def test_holder_records_an_operation_under_its_generation(agent_client, agent, workspace):
    run = HeartbeatRunFactory(company=workspace.company, agent=agent)
    post(agent_client, workspace.pk, {"action": "start", "run_id": str(run.pk)})

    response = operation(
        agent_client,
        workspace.pk,
        generation=1,
        run_id=str(run.pk),
        command="npm run dev",
        status="succeeded",
        exit_code=0,
    )

    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["lease_generation"] == 1
    assert body["heartbeat_run_id"] == str(run.pk)
    assert body["status"] == "succeeded"
    assert body["finished_at"] is not None
    row = WorkspaceOperation.objects.get()
    assert (row.lease_generation, row.phase, row.command, row.exit_code) == (
        1,
        "runtime_start",
        "npm run dev",
        0,
    )
    assert ActivityEvent.objects.filter(action="workspace_operation.recorded").count() == 1


def test_expired_but_unreclaimed_lease_still_fences_for_its_holder(agent_client, workspace):
    post(agent_client, workspace.pk, {"action": "start"})
    expire(workspace)
    response = operation(agent_client, workspace.pk, generation=1)
    assert response.status_code == 201
    assert response.json()["finished_at"] is None


def test_superseded_generation_is_rejected_after_a_reclaim(
    agent_client, make_agent_client, workspace
):
    post(agent_client, workspace.pk, {"action": "start"})
    expire(workspace)
    rival_client = make_agent_client(AgentFactory(company=workspace.company))
    assert post(rival_client, workspace.pk, {"action": "start"}).json()["outcome"] == "reclaimed"

    stale = operation(agent_client, workspace.pk, generation=1)
    wrong_generation = operation(rival_client, workspace.pk, generation=1)
    current = operation(rival_client, workspace.pk, generation=2)

    error = assert_error(stale, 409, "workspace_runtime_lease_superseded")
    assert error["details"]["current_generation"] == 2
    assert error["details"]["requested_generation"] == 1
    assert_error(wrong_generation, 409, "workspace_runtime_lease_superseded")
    assert current.status_code == 201
    assert list(WorkspaceOperation.objects.values_list("lease_generation", flat=True)) == [2]
    # The refusals rolled back but left their own audit rows.
    assert (
        ActivityEvent.objects.filter(action="runtime_lease.superseded_write_rejected").count() == 2
    )


def test_write_without_any_lease_is_superseded_with_null_generation(agent_client, workspace):
    response = operation(agent_client, workspace.pk, generation=1)
    assert response.status_code == 409
    assert response.json()["error"]["details"]["current_generation"] is None
    assert WorkspaceOperation.objects.count() == 0


def test_write_after_release_and_recreate_with_old_generation_is_rejected(agent_client, workspace):
    post(agent_client, workspace.pk, {"action": "start"})
    post(agent_client, workspace.pk, {}, "runtime-lease/release")
    assert post(agent_client, workspace.pk, {"action": "start"}).json()["lease"]["generation"] == 2
    # Same owner key, but the generation it fenced with is gone for good.
    response = operation(agent_client, workspace.pk, generation=1)
    assert_error(response, 409, "workspace_runtime_lease_superseded")


@pytest.mark.parametrize(
    "body",
    [
        {"status": "running"},  # no generation
        {"generation": 0, "status": "running"},
        {"generation": 1, "status": "exploded"},
        {"generation": 1, "status": "running", "phase": ""},
        {"generation": 1, "status": "running", "exit_code": 2**40},
    ],
)
def test_malformed_operation_is_400(agent_client, workspace, body):
    post(agent_client, workspace.pk, {"action": "start"})
    response = post(agent_client, workspace.pk, {"phase": "p", **body}, "operations")
    assert_error(response, 400, "invalid_request")
    assert WorkspaceOperation.objects.count() == 0


def test_board_cannot_record_fenced_operations(board_client, workspace):
    response = operation(board_client, workspace.pk, generation=1)
    assert response.status_code == 403


def test_operation_owner_ids_are_checked_like_a_claim(
    agent_client, agent, workspace, other_company
):
    post(agent_client, workspace.pk, {"action": "start"})
    cases = [
        ({"issue_id": str(IssueFactory(company=other_company).pk)}, 404, "not_found"),
        ({"issue_id": str(uuid.uuid4())}, 404, "not_found"),
        ({"run_id": str(HeartbeatRunFactory(company=other_company).pk)}, 404, "not_found"),
        (
            {"run_id": str(HeartbeatRunFactory(company=workspace.company).pk)},
            403,
            "permission_denied",
        ),
    ]
    for extra, http_status, code in cases:
        response = operation(agent_client, workspace.pk, generation=1, **extra)
        assert response.status_code == http_status, (extra, response.json())
        assert_error(response, http_status, code)
    assert WorkspaceOperation.objects.count() == 0
    # Refused before the fence is consulted: not recorded as a superseded write either.
    assert not ActivityEvent.objects.filter(
        action="runtime_lease.superseded_write_rejected"
    ).exists()


def test_operation_naming_another_owner_key_is_superseded(agent_client, agent, workspace):
    post(agent_client, workspace.pk, {"action": "start"})  # held by agent:<id>
    issue = IssueFactory(company=workspace.company)
    response = operation(agent_client, workspace.pk, generation=1, issue_id=str(issue.pk))
    assert response.status_code == 409
    details = response.json()["error"]["details"]
    assert details["requested_owner_key"] == f"issue:{issue.pk}"
    assert details["owner_key"] == f"agent:{agent.pk}"
    assert details["current_generation"] == 1
    assert WorkspaceOperation.objects.count() == 0


def test_operation_unauthenticated_is_401(client, workspace):
    response = client.post(
        url(workspace.pk, "operations"),
        {"generation": 1, "phase": "p", "status": "running"},
        content_type="application/json",
    )
    assert_error(response, 401, "not_authenticated")


def test_operation_on_foreign_workspace_is_404(agent_client, other_company):
    foreign = ExecutionWorkspaceFactory(company=other_company)
    response = operation(agent_client, foreign.pk, generation=1)
    assert response.status_code == 404


def test_schema_documents_the_lease_endpoints(board_client):
    response = board_client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert response.status_code == 200
    text = response.content.decode()
    for path in ("runtime-lease/claim", "runtime-lease/release", "/operations"):
        assert path in text
    assert "workspace_runtime_lease_conflict" in text


def test_a_board_claim_names_only_ids_of_the_workspace_company(
    board_client, workspace, other_company
):
    own_issue = IssueFactory(company=workspace.company)
    for extra in (
        {"issue_id": str(uuid.uuid4())},
        {"issue_id": str(IssueFactory(company=other_company).pk)},
        {"run_id": str(uuid.uuid4())},
        {"run_id": str(HeartbeatRunFactory(company=other_company).pk)},
    ):
        before = ActivityEvent.objects.count()
        for suffix in ("runtime-lease/claim", "runtime-lease/release"):
            action = {"action": "start"} if suffix.endswith("claim") else {}
            response = post(board_client, workspace.pk, {**action, **extra}, suffix)
            assert_error(response, 404, "not_found")
        assert ActivityEvent.objects.count() == before  # nothing audited for a bad id
    ok = post(board_client, workspace.pk, {"action": "start", "issue_id": str(own_issue.pk)})
    assert ok.json()["outcome"] == "bypassed"


@pytest.mark.parametrize("force", [True, 1, 0, "yes", []])
def test_an_agent_sending_force_in_any_form_is_refused(agent_client, workspace, force):
    response = post(agent_client, workspace.pk, {"force": force}, "runtime-lease/release")
    assert_error(response, 403, "permission_denied")


def test_a_force_release_is_on_the_evicted_runs_record(make_board_client: Any) -> None:
    """The audit row named no run, so the evicted run's page showed nothing of its eviction
    (found trying the console as a new operator)."""
    run, held = running_run()
    assert held is not None
    board = make_board_client(run.company)
    response = post(
        board,
        run.execution_workspace_id,
        {"force": True, "reason": "host rebuilt"},
        "runtime-lease/release",
    )
    assert response.json()["released"] is True
    event = ActivityEvent.objects.get(action="runtime_lease.force_released")
    assert event.run_id == run.pk
