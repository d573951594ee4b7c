"""Core API: companies, agents, keys, issues, execution workspaces."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from rest_framework.test import APIClient

from paperclip.models import (
    ActivityEvent,
    Agent,
    AgentApiKey,
    BoardMembership,
    Company,
    ExecutionWorkspace,
    Issue,
)
from tests.helpers import assert_error
from tests.paperclip.factories import AgentFactory, ExecutionWorkspaceFactory, IssueFactory
from tests.paperclip.helpers import audit_count

pytestmark = pytest.mark.django_db


# --- companies --------------------------------------------------------------------------------


def test_superuser_creates_a_company_and_becomes_a_member(make_board_client) -> None:
    client = make_board_client(superuser=True)
    response = client.post("/api/companies", {"name": "Acme"}, format="json")
    assert response.status_code == 201
    body = response.json()
    assert body["name"] == "Acme"
    company = Company.objects.get(pk=body["id"])
    assert BoardMembership.objects.filter(user=client.user, company=company).exists()
    event = ActivityEvent.objects.get(action="company.created")
    assert (event.company_id, event.actor_type, event.actor_id) == (
        company.pk,
        "user",
        str(client.user.pk),
    )


def test_non_superuser_board_and_agents_cannot_create_companies(
    board_client: APIClient, agent_client: APIClient
) -> None:
    assert_error(
        board_client.post("/api/companies", {"name": "X"}, format="json"), 403, "permission_denied"
    )
    assert_error(
        agent_client.post("/api/companies", {"name": "X"}, format="json"), 403, "permission_denied"
    )
    assert not Company.objects.filter(name="X").exists()


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "name"),
        ({"name": ""}, "name"),
        ({"name": "   "}, "name"),
        ({"name": "x" * 201}, "name"),
        ({"name": 5, "extra": 1}, "extra"),
        ({"name": "a\x00b"}, "name"),
    ],
)
def test_company_create_validates_fields(
    make_board_client, body: dict[str, Any], field: str
) -> None:
    client = make_board_client(superuser=True)
    before = (Company.objects.count(), audit_count())
    error = assert_error(client.post("/api/companies", body, format="json"), 400, "invalid_request")
    assert field in error["details"]["fields"]
    assert (Company.objects.count(), audit_count()) == before


def test_malformed_json_is_400(make_board_client) -> None:
    client = make_board_client(superuser=True)
    response = client.post("/api/companies", "{not json", content_type="application/json")
    assert_error(response, 400, "invalid_request")


def test_non_object_json_body_is_400(make_board_client) -> None:
    client = make_board_client(superuser=True)
    response = client.post("/api/companies", "[1, 2]", content_type="application/json")
    assert_error(response, 400, "invalid_request")


def test_wrong_content_type_is_415(make_board_client) -> None:
    client = make_board_client(superuser=True)
    response = client.post("/api/companies", "name=x", content_type="text/plain")
    assert_error(response, 415, "unsupported_media_type")


def test_wrong_method_is_405(make_board_client) -> None:
    client = make_board_client(superuser=True)
    assert_error(client.get("/api/companies"), 405, "method_not_allowed")


# --- agents and keys --------------------------------------------------------------------------


def test_board_creates_an_agent(board_client: APIClient, company: Company) -> None:
    response = board_client.post(
        f"/api/companies/{company.pk}/agents", {"name": "bot"}, format="json"
    )
    assert response.status_code == 201
    body = response.json()
    assert body["company_id"] == str(company.pk)
    assert body["name"] == "bot"
    assert audit_count("agent.created") == 1


def test_agent_create_validates_name(board_client: APIClient, company: Company) -> None:
    error = assert_error(
        board_client.post(f"/api/companies/{company.pk}/agents", {"name": ""}, format="json"),
        400,
        "invalid_request",
    )
    assert "name" in error["details"]["fields"]
    assert not Agent.objects.exists()


def test_board_mints_a_working_agent_key_and_revokes_it(
    board_client: APIClient, agent: Agent
) -> None:
    response = board_client.post(f"/api/agents/{agent.pk}/keys", format="json")
    assert response.status_code == 201
    body = response.json()
    assert body["key"].startswith(f"pcak_{body['prefix']}.")
    assert body["agent_id"] == str(agent.pk)
    agent_client = APIClient()
    agent_client.credentials(HTTP_AUTHORIZATION=f"Bearer {body['key']}")
    assert agent_client.get("/api/me").json()["agent_id"] == str(agent.pk)

    revoked = board_client.post(f"/api/agent-keys/{body['id']}/revoke")
    assert revoked.status_code == 200
    assert revoked.json()["id"] == body["id"]
    assert revoked.json()["revoked_at"]
    assert_error(agent_client.get("/api/me"), 401, "not_authenticated")

    again = board_client.post(f"/api/agent-keys/{body['id']}/revoke")
    assert again.status_code == 200
    assert again.json()["revoked_at"] == revoked.json()["revoked_at"]
    assert audit_count("agent_key.created") == 1
    assert audit_count("agent_key.revoked") == 1


def test_key_name_is_validated(board_client: APIClient, agent: Agent) -> None:
    response = board_client.post(f"/api/agents/{agent.pk}/keys", {"name": 3, "x": 1}, format="json")
    assert "x" in assert_error(response, 400, "invalid_request")["details"]["fields"]
    assert not AgentApiKey.objects.exists()


# --- issues -----------------------------------------------------------------------------------


def test_board_creates_an_issue(board_client: APIClient, company: Company, agent: Agent) -> None:
    response = board_client.post(
        f"/api/companies/{company.pk}/issues",
        {"title": "Do it", "status": "todo", "assignee_agent_id": str(agent.pk)},
        format="json",
    )
    assert response.status_code == 201
    body = response.json()
    assert {k: body[k] for k in ("company_id", "title", "status", "assignee_agent_id")} == {
        "company_id": str(company.pk),
        "title": "Do it",
        "status": "todo",
        "assignee_agent_id": str(agent.pk),
    }
    assert body["hidden_at"] is None
    assert body["execution_run_id"] is None
    assert body["checkout_run_id"] is None
    assert audit_count("issue.created") == 1


def test_issue_defaults_to_backlog(board_client: APIClient, company: Company) -> None:
    response = board_client.post(
        f"/api/companies/{company.pk}/issues", {"title": "t"}, format="json"
    )
    assert response.json()["status"] == "backlog"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "title"),
        ({"title": ""}, "title"),
        ({"title": "t", "status": "nope"}, "status"),
        ({"title": "t", "assignee_agent_id": "not-a-uuid"}, "assignee_agent_id"),
        ({"title": "t", "hidden": True}, "hidden"),
    ],
)
def test_issue_create_validates_fields(
    board_client: APIClient, company: Company, body: dict[str, Any], field: str
) -> None:
    before = audit_count()
    response = board_client.post(f"/api/companies/{company.pk}/issues", body, format="json")
    assert field in assert_error(response, 400, "invalid_request")["details"]["fields"]
    assert not Issue.objects.exists()
    assert audit_count() == before


def test_issue_assignee_must_be_in_the_company(
    board_client: APIClient, company: Company, other_company: Company
) -> None:
    before = audit_count()
    foreign = AgentFactory(company=other_company)
    for assignee in (foreign.pk, uuid.uuid4()):
        response = board_client.post(
            f"/api/companies/{company.pk}/issues",
            {"title": "t", "assignee_agent_id": str(assignee)},
            format="json",
        )
        assert_error(response, 404, "not_found")
    assert not Issue.objects.exists()
    assert audit_count() == before


def test_issue_read_by_board_and_company_agents(
    board_client: APIClient, agent_client: APIClient, company: Company
) -> None:
    issue = IssueFactory(company=company)
    for client in (board_client, agent_client):
        response = client.get(f"/api/issues/{issue.pk}")
        assert response.status_code == 200
        assert response.json()["id"] == str(issue.pk)


def test_issue_patch_status_and_hidden(board_client: APIClient, company: Company) -> None:
    issue = IssueFactory(company=company, status="todo")
    response = board_client.patch(
        f"/api/issues/{issue.pk}", {"status": "in_review", "hidden": True}, format="json"
    )
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "in_review"
    assert body["hidden_at"] is not None
    event = ActivityEvent.objects.get(action="issue.updated")
    assert event.details == {
        "status": {"from": "todo", "to": "in_review"},
        "hidden": {"from": False, "to": True},
    }

    # Hiding again keeps the original hidden_at and writes nothing.
    again = board_client.patch(f"/api/issues/{issue.pk}", {"hidden": True}, format="json")
    assert again.json()["hidden_at"] == body["hidden_at"]
    assert audit_count("issue.updated") == 1

    shown = board_client.patch(f"/api/issues/{issue.pk}", {"hidden": False}, format="json")
    assert shown.json()["hidden_at"] is None
    assert audit_count("issue.updated") == 2


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "non_field_errors"),
        ({"status": "nope"}, "status"),
        ({"hidden": "yes"}, "hidden"),
        ({"hidden": 1}, "hidden"),
        ({"hidden": None}, "hidden"),
        ({"title": "renamed"}, "title"),
    ],
)
def test_issue_patch_validates_fields(
    board_client: APIClient, company: Company, body: dict[str, Any], field: str
) -> None:
    before = audit_count()
    issue = IssueFactory(company=company, status="todo")
    response = board_client.patch(f"/api/issues/{issue.pk}", body, format="json")
    assert field in assert_error(response, 400, "invalid_request")["details"]["fields"]
    issue.refresh_from_db()
    assert issue.status == "todo"
    assert issue.hidden_at is None
    assert audit_count() == before


def test_agent_cannot_patch_an_issue(agent_client: APIClient, company: Company) -> None:
    issue = IssueFactory(company=company, status="todo")
    response = agent_client.patch(f"/api/issues/{issue.pk}", {"status": "done"}, format="json")
    assert_error(response, 403, "permission_denied")
    issue.refresh_from_db()
    assert issue.status == "todo"


# --- execution workspaces ---------------------------------------------------------------------


def test_board_creates_and_reads_a_workspace(
    board_client: APIClient, agent_client: APIClient, company: Company
) -> None:
    response = board_client.post(
        f"/api/companies/{company.pk}/execution-workspaces",
        {"name": "main", "cwd": "/srv/work/main"},
        format="json",
    )
    assert response.status_code == 201
    body = response.json()
    assert {k: body[k] for k in ("company_id", "name", "cwd", "status")} == {
        "company_id": str(company.pk),
        "name": "main",
        "cwd": "/srv/work/main",
        "status": "active",
    }
    assert audit_count("execution_workspace.created") == 1
    for client in (board_client, agent_client):
        assert client.get(f"/api/execution-workspaces/{body['id']}").json() == body


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "name"),
        ({"name": "w", "cwd": "relative/dir"}, "cwd"),
        ({"name": "w", "cwd": "/srv/../etc"}, "cwd"),
        ({"name": "w", "cwd": ""}, "cwd"),
        ({"name": "w", "cwd": "/a\x00b"}, "cwd"),
        ({"name": "w", "cwd": 7}, "cwd"),
    ],
)
def test_workspace_create_validates_fields(
    board_client: APIClient, company: Company, body: dict[str, Any], field: str
) -> None:
    before = audit_count()
    response = board_client.post(
        f"/api/companies/{company.pk}/execution-workspaces", body, format="json"
    )
    assert field in assert_error(response, 400, "invalid_request")["details"]["fields"]
    assert not ExecutionWorkspace.objects.exists()
    assert audit_count() == before


def assert_cwd_refused(client: APIClient, company: Company, cwd: str) -> None:
    """A workspace of `company` with `cwd` is refused with 422 `workspace_cwd_not_allowed`,
    naming nothing, and nothing is written: no workspace, no audit row."""
    before = audit_count()
    response = client.post(
        f"/api/companies/{company.pk}/execution-workspaces",
        {"name": "borrowed", "cwd": cwd},
        format="json",
    )
    assert assert_error(response, 422, "workspace_cwd_not_allowed")["details"] == {}
    assert not ExecutionWorkspace.objects.filter(company=company).exists()
    assert audit_count() == before


@pytest.mark.parametrize("target", ["theirs", "inside", "holding", "link", "data", "store"])
def test_a_board_member_cannot_give_a_workspace_another_companys_cwd(
    make_board_client: Callable[..., APIClient],
    company: Company,
    tmp_path: Path,
    settings: Any,
    target: str,
) -> None:
    """A workspace's cwd is adopted as its head and materialized by a worker that may run as
    root: a cwd that is, holds or lies inside another company's workspace cwd (links
    resolved), the data directory or the blob store would let this company's board read or
    overwrite what is not its own. Refused with one code that names nothing of the other
    company; nothing written."""
    settings.DATA_DIR = tmp_path / "data"
    settings.PAPERCLIP_CAS_DIR = tmp_path / "blobs"
    theirs = tmp_path / "workspaces" / "b" / "work"
    theirs.mkdir(parents=True)
    ExecutionWorkspaceFactory(cwd=str(theirs))  # another company's
    (tmp_path / "innocent").symlink_to(theirs)
    cwd = {
        "theirs": str(theirs),
        "inside": str(theirs / "src"),
        "holding": str(tmp_path / "workspaces"),
        "link": str(tmp_path / "innocent"),
        "data": str(tmp_path / "data" / "pgdata"),
        "store": str(tmp_path / "blobs"),
    }[target]
    assert_cwd_refused(make_board_client(company), company, cwd)


def test_a_cwd_beside_another_companys_or_shared_within_the_company_is_allowed(
    make_board_client: Callable[..., APIClient], company: Company, tmp_path: Path
) -> None:
    ExecutionWorkspaceFactory(cwd=str(tmp_path / "workspaces" / "b"))
    ExecutionWorkspaceFactory(company=company, cwd=str(tmp_path / "workspaces" / "a"))
    client = make_board_client(company)
    for cwd in (tmp_path / "workspaces" / "bb", tmp_path / "workspaces" / "a" / "sub"):
        response = client.post(
            f"/api/companies/{company.pk}/execution-workspaces",
            {"name": "w", "cwd": str(cwd)},
            format="json",
        )
        assert response.status_code == 201, response.json()


def test_a_superuser_may_give_a_workspace_any_cwd(
    make_board_client: Callable[..., APIClient], company: Company, tmp_path: Path
) -> None:
    ExecutionWorkspaceFactory(cwd=str(tmp_path / "workspaces" / "b"))
    response = make_board_client(superuser=True).post(
        f"/api/companies/{company.pk}/execution-workspaces",
        {"name": "w", "cwd": str(tmp_path / "workspaces")},
        format="json",
    )
    assert response.status_code == 201, response.json()


# --- scoping: another company's objects are 404 everywhere; malformed ids are JSON 404 ------


def _foreign_requests(other: Company) -> list[tuple[str, str, dict[str, Any] | None]]:
    agent = AgentFactory(company=other)
    key = AgentApiKey.objects.create(agent=agent, prefix="abcdef012345", secret_sha256="0" * 64)
    issue = IssueFactory(company=other)
    workspace = ExecutionWorkspaceFactory(company=other)
    from tests.paperclip.factories import HeartbeatRunFactory

    run = HeartbeatRunFactory(company=other, agent=agent)
    return [
        ("post", f"/api/companies/{other.pk}/agents", {"name": "x"}),
        ("post", f"/api/companies/{other.pk}/issues", {"title": "x"}),
        ("post", f"/api/companies/{other.pk}/execution-workspaces", {"name": "x"}),
        ("post", f"/api/agents/{agent.pk}/keys", {}),
        ("post", f"/api/agent-keys/{key.pk}/revoke", None),
        ("get", f"/api/issues/{issue.pk}", None),
        ("patch", f"/api/issues/{issue.pk}", {"status": "done"}),
        ("get", f"/api/execution-workspaces/{workspace.pk}", None),
        ("get", f"/api/heartbeat-runs/{run.pk}", None),
        ("patch", f"/api/heartbeat-runs/{run.pk}", {"status": "failed"}),
    ]


def test_other_companys_objects_are_404_for_the_board(
    board_client: APIClient, other_company: Company
) -> None:
    requests = _foreign_requests(other_company)
    before = audit_count()
    for method, url, body in requests:
        response = getattr(board_client, method)(url, body, format="json")
        assert_error(response, 404, "not_found")
    assert audit_count() == before
    assert not AgentApiKey.objects.filter(revoked_at__isnull=False).exists()


def test_other_companys_objects_are_404_for_agents(
    agent_client: APIClient, other_company: Company
) -> None:
    for method, url, body in _foreign_requests(other_company):
        if "/heartbeat-runs/" in url or url.startswith(
            ("/api/issues", "/api/execution-workspaces")
        ):
            response = getattr(agent_client, method)(url, body, format="json")
            # PATCH on an issue is board-only: 403 before any lookup, revealing nothing.
            expected = (
                (403, "permission_denied")
                if method == "patch" and "/issues/" in url
                else (404, "not_found")
            )
            assert_error(response, *expected)


@pytest.mark.parametrize(
    "url",
    [
        "/api/issues/not-a-uuid",
        "/api/issues/123",
        "/api/execution-workspaces/zzz",
        "/api/heartbeat-runs/%00",
        "/api/companies/nope/agents",
        "/api/agent-keys/x/revoke",
        "/api/agents/x/keys",
    ],
)
def test_malformed_ids_in_paths_are_json_404(board_client: APIClient, url: str) -> None:
    for method in ("get", "post", "patch"):
        response = getattr(board_client, method)(url, {}, format="json")
        assert_error(response, 404, "not_found")


def test_unknown_ids_are_404(board_client: APIClient) -> None:
    missing = uuid.uuid4()
    for url in (
        f"/api/issues/{missing}",
        f"/api/heartbeat-runs/{missing}",
        f"/api/execution-workspaces/{missing}",
    ):
        assert_error(board_client.get(url), 404, "not_found")


def test_member_of_two_companies_acts_in_both(
    make_board_client: Callable[..., APIClient], company: Company, other_company: Company
) -> None:
    client = make_board_client(company, other_company)
    for c in (company, other_company):
        assert (
            client.post(f"/api/companies/{c.pk}/issues", {"title": "t"}, format="json").status_code
            == 201
        )


@pytest.mark.parametrize("target", ["their_run_dir", "inside_their_run_dir", "copyback_root"])
def test_a_board_member_cannot_give_a_workspace_another_companys_run_directory_or_a_root(
    make_board_client: Callable[..., APIClient],
    company: Company,
    tmp_path: Path,
    settings: Any,
    target: str,
) -> None:
    """The copy-back roots hold every company's run directories: a cwd naming another
    company's run directory, or the root that holds them all, would be adopted as this
    company's head as another company's workspace cwd would, and would make every copy-back
    under it refused (`inside_execution_workspace`)."""
    from tests.paperclip.factories import HeartbeatRunFactory

    roots = tmp_path / "runs"
    theirs = roots / "run-b"
    theirs.mkdir(parents=True)
    (theirs / "secret.txt").write_text("company B's work")
    settings.PAPERCLIP_COPYBACK_ROOTS = [str(roots)]
    HeartbeatRunFactory(  # another company's run, its directory under the root
        runner_profile_json={"nativeExecutionInput": {"binding": {"workspaceDir": str(theirs)}}}
    )
    cwd = {
        "their_run_dir": str(theirs),
        "inside_their_run_dir": str(theirs / "src"),
        "copyback_root": str(roots),
    }[target]
    assert_cwd_refused(make_board_client(company), company, cwd)


def test_a_relative_store_directory_is_still_refused(
    make_board_client: Callable[..., APIClient],
    company: Company,
    tmp_path: Path,
    settings: Any,
) -> None:
    """A relative PAPERCLIP_CAS_DIR is resolved as the copy-back guard resolves it."""
    import os

    store = tmp_path / "blobs"
    store.mkdir()
    settings.PAPERCLIP_CAS_DIR = Path(os.path.relpath(store))
    assert_cwd_refused(make_board_client(company), company, str(store))
