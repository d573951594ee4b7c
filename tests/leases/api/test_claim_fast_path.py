"""The claim endpoint (the renew hot path) reads and renders exactly through its serializers.

The view renders with one shared OutputSerializer instance (`shared_serializer`); it must give
what a fresh serializer gives, and the response shape below is pinned field by field.
"""

from __future__ import annotations

import json
import uuid

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from rest_framework import serializers

from leases.api.views import RuntimeLeaseClaimApi
from leases.models import WorkspaceRuntimeLease
from leases.services import (
    RuntimeLeaseClaim,
    RuntimeLeaseOwner,
    runtime_lease_claim,
    runtime_lease_get,
)
from paperclip.api.serializers import shared_serializer
from paperclip.models import Issue
from tests.leases.factories import claim
from tests.paperclip.factories import AgentFactory, IssueFactory

pytestmark = pytest.mark.django_db

ISSUE = str(uuid.uuid4())


def url(workspace):
    return f"/api/execution-workspaces/{workspace.pk}/runtime-lease/claim"


DATETIME = serializers.DateTimeField()


def serialized(result):
    return RuntimeLeaseClaimApi.OutputSerializer().to_representation(result)


def rendered(result):
    """What the view renders: the shared serializer instance."""
    return shared_serializer(RuntimeLeaseClaimApi.OutputSerializer).to_representation(result)


def uuid_text(value):
    return None if value is None else str(value)


def expected_body(result):
    """The response body, field by field, from the service's dataclasses."""
    lease, reclaimed = result.lease, result.reclaimed_from
    return {
        "outcome": result.outcome,
        "owner_key": result.owner_key,
        "lease": None
        if lease is None
        else {
            "id": str(lease.id),
            "company_id": str(lease.company_id),
            "execution_workspace_id": str(lease.execution_workspace_id),
            "owner_key": lease.owner_key,
            "owner_issue_id": uuid_text(lease.owner_issue_id),
            "owner_run_id": uuid_text(lease.owner_run_id),
            "owner_agent_id": uuid_text(lease.owner_agent_id),
            "last_action": lease.last_action,
            "generation": lease.generation,
            "fence": lease.fence,
            "claimed_at": DATETIME.to_representation(lease.claimed_at),
            "renewed_at": DATETIME.to_representation(lease.renewed_at),
            "expires_at": DATETIME.to_representation(lease.expires_at),
            "metadata": lease.metadata,
        },
        "reclaimed_from": None
        if reclaimed is None
        else {"owner_key": reclaimed.owner_key, "reason": reclaimed.reason},
    }


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
        assert rendered(result) == serialized(result) == expected_body(result)
        assert list(rendered(result)) == list(expected_body(result))  # key order of the JSON
    assert rendered(reclaimed)["lease"]["metadata"]["reclaimReason"] == "owner_issue_terminal"


def test_http_response_is_the_rendering_of_the_lease(agent_client, workspace):
    issue = IssueFactory(company=workspace.company)
    body = {"action": "start", "issue_id": str(issue.pk)}
    for outcome in ("created", "renewed"):
        response = agent_client.post(url(workspace), body, "json")
        assert response.status_code == 200, response.content
        lease = runtime_lease_get(execution_workspace_id=workspace.pk).lease
        result = RuntimeLeaseClaim(outcome=outcome, owner_key=f"issue:{issue.pk}", lease=lease)
        assert response.json() == expected_body(result)
        assert list(response.json()) == list(expected_body(result))


@pytest.mark.parametrize(
    ("body", "values"),
    [
        ({"action": "start"}, ("start", None, None, None)),
        ({"action": "repair", "ttl_seconds": 60}, ("repair", 60, None, None)),
        (
            {"action": "stop", "ttl_seconds": 86_400, "issue_id": ISSUE, "run_id": None},
            ("stop", 86_400, uuid.UUID(ISSUE), None),
        ),
        (
            {"action": "restart", "issue_id": ISSUE.upper(), "ttl_seconds": None},
            ("restart", None, uuid.UUID(ISSUE), None),
        ),
    ],
)
def test_plain_bodies_are_read_as_expected(body, values):
    serializer = RuntimeLeaseClaimApi.InputSerializer(data=body)
    assert serializer.is_valid(), serializer.errors
    keys = ("action", "ttl_seconds", "issue_id", "run_id")
    assert tuple(serializer.validated_data.get(key) for key in keys) == values


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (None, "non_field_errors"),
        (["start"], "non_field_errors"),
        ("start", "non_field_errors"),
        ({}, "action"),
        ({"action": None}, "action"),
        ({"action": "destroy"}, "action"),
        ({"action": 1}, "action"),
        ({"action": "start", "ttl_seconds": 59}, "ttl_seconds"),
        ({"action": "start", "ttl_seconds": 86_401}, "ttl_seconds"),
        ({"action": "start", "ttl_seconds": True}, "ttl_seconds"),
        ({"action": "start", "ttl_seconds": "120"}, "ttl_seconds"),
        ({"action": "start", "ttl_seconds": 120.0}, "ttl_seconds"),
        ({"action": "start", "extra": 1}, "extra"),
        ({"action": "start", "issue_id": "not-a-uuid"}, "issue_id"),
        ({"action": "start", "issue_id": 12}, "issue_id"),
        ({"action": "start", "issue_id": "{" + ISSUE + "}"}, "issue_id"),
        ({"action": "start", "run_id": ISSUE.replace("-", "")}, "run_id"),
        ({"action": "start", "run_id": ["x"]}, "run_id"),
    ],
)
def test_malformed_bodies_are_400_naming_the_field(agent_client, workspace, body, field):
    serializer = RuntimeLeaseClaimApi.InputSerializer(data=body)
    assert not serializer.is_valid()
    assert list(serializer.errors) == [field]
    response = agent_client.post(url(workspace), json.dumps(body), content_type="application/json")
    assert response.status_code == 400
    assert response.json()["error"] == {
        "code": "invalid_request",
        "message": "The request is malformed.",
        "details": {"fields": serializer.errors},
    }
    assert not WorkspaceRuntimeLease.objects.exists()


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
