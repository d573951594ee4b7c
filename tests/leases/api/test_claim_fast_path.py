"""The claim endpoint's hand-written validation and rendering agree with its serializers."""

from __future__ import annotations

import uuid

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from leases.api.views import RuntimeLeaseClaimApi, _plain_claim_input, claim_body
from leases.models import WorkspaceRuntimeLease
from leases.services import RuntimeLeaseOwner, runtime_lease_claim
from paperclip.models import Issue
from tests.leases.factories import claim
from tests.paperclip.factories import AgentFactory, ExecutionWorkspaceFactory, IssueFactory

pytestmark = pytest.mark.django_db

ISSUE = str(uuid.uuid4())


@pytest.fixture
def workspace(company):
    return ExecutionWorkspaceFactory(company=company)


def url(workspace):
    return f"/api/execution-workspaces/{workspace.pk}/runtime-lease/claim"


def serialized(result):
    return RuntimeLeaseClaimApi.OutputSerializer().to_representation(result)


def test_rendering_matches_the_serializer_for_every_outcome(agent, workspace):
    issue = IssueFactory(company=workspace.company)
    created = claim(workspace, agent, issue_id=issue.pk)
    renewed = claim(workspace, agent, issue_id=issue.pk, ttl_seconds=120)
    Issue.objects.filter(pk=issue.pk).update(status="done")
    reclaimed = claim(workspace, AgentFactory(company=workspace.company))
    bypassed = runtime_lease_claim(
        company_id=workspace.company_id,
        execution_workspace_id=workspace.pk,
        action="stop",
        owner=RuntimeLeaseOwner.for_board(1),
    )
    outcomes = [r.outcome for r in (created, renewed, reclaimed, bypassed)]
    assert outcomes == ["created", "renewed", "reclaimed", "bypassed"]
    for result in (created, renewed, reclaimed, bypassed):
        assert claim_body(result) == serialized(result)
    assert claim_body(reclaimed)["lease"]["metadata"]["reclaimReason"] == "owner_issue_terminal"


@pytest.mark.parametrize(
    "body",
    [
        {"action": "start"},
        {"action": "repair", "ttl_seconds": 60},
        {"action": "stop", "ttl_seconds": 86_400, "issue_id": ISSUE, "run_id": None},
        {"action": "restart", "issue_id": ISSUE.upper(), "ttl_seconds": None, "extra": 1},
    ],
)
def test_plain_bodies_are_read_as_the_serializer_reads_them(body):
    plain = _plain_claim_input(body)
    assert plain is not None
    serializer = RuntimeLeaseClaimApi.InputSerializer(data=body)
    assert serializer.is_valid(), serializer.errors
    for key in ("action", "ttl_seconds", "issue_id", "run_id"):
        assert plain[key] == serializer.validated_data.get(key)


@pytest.mark.parametrize(
    "body",
    [
        None,
        ["start"],
        "start",
        {},
        {"action": None},
        {"action": "destroy"},
        {"action": 1},
        {"action": "start", "ttl_seconds": 59},
        {"action": "start", "ttl_seconds": 86_401},
        {"action": "start", "ttl_seconds": True},
        {"action": "start", "ttl_seconds": "120"},
        {"action": "start", "ttl_seconds": 120.0},
        {"action": "start", "issue_id": "not-a-uuid"},
        {"action": "start", "issue_id": 12},
        {"action": "start", "run_id": ["x"]},
    ],
)
def test_everything_else_goes_to_the_serializer(body):
    assert _plain_claim_input(body) is None


@pytest.mark.parametrize("ttl", ["120", 120.0])
def test_forms_only_the_serializer_accepts_still_work(agent_client, workspace, ttl):
    response = agent_client.post(url(workspace), {"action": "start", "ttl_seconds": ttl}, "json")
    assert response.status_code == 200, response.content
    lease = WorkspaceRuntimeLease.objects.get(execution_workspace=workspace)
    assert (lease.expires_at - lease.renewed_at).total_seconds() == pytest.approx(120, abs=1)


def test_boolean_ttl_is_still_a_400(agent_client, workspace):
    response = agent_client.post(url(workspace), {"action": "start", "ttl_seconds": True}, "json")
    assert response.status_code == 400
    assert response.json()["error"]["details"]["fields"]["ttl_seconds"]
    assert not WorkspaceRuntimeLease.objects.exists()


def test_http_renew_is_two_statements(agent_client, workspace):
    """Authentication (one statement: last_used_at was just written) plus the service's renew
    (one statement)."""
    assert agent_client.post(url(workspace), {"action": "start"}, "json").status_code == 200
    with CaptureQueriesContext(connection) as queries:
        response = agent_client.post(url(workspace), {"action": "start"}, "json")
    assert response.json()["outcome"] == "renewed"
    assert len(queries) == 2, [q["sql"] for q in queries]
