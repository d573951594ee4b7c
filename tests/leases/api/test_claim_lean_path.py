"""The claim endpoint's lean path (leases/api/lean.py) answers exactly as the DRF view does.

Each request is sent twice where it changes nothing, once down the lean path and once with
PAPERCLIP_LEAN_CLAIM_VIEW=false (every claim through the DRF view), and the two answers must
be equal: status, JSON, headers. Requests that change state are checked for the lean path
being the one taken, and against the serializers, the audit rows, the metrics and the request
log line. Behaviour only: nothing here measures time.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

import pytest
from django.test import override_settings
from rest_framework import serializers
from rest_framework.test import APIClient

from leases.api import lean
from leases.api.views import RuntimeLeaseClaimApi
from paperclip.api.serializers import StrictInputSerializer, validated_body
from paperclip.credentials import agent_key_create, agent_key_revoke
from paperclip.models import ActivityEvent, Agent
from tests.helpers import assert_error, each_way, sample
from tests.leases.factories import claim, expire
from tests.paperclip.factories import (
    AgentFactory,
    ExecutionWorkspaceFactory,
    HeartbeatRunFactory,
    IssueFactory,
)

pytestmark = pytest.mark.django_db


def url(workspace_id: Any) -> str:
    return f"/api/execution-workspaces/{workspace_id}/runtime-lease/claim"


@pytest.fixture
def drf_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The requests the lean view handed to the DRF view (by path)."""
    calls: list[str] = []
    real = lean.drf_view

    def spy(request: Any, **kwargs: Any) -> Any:
        calls.append(request.path)
        return real(request, **kwargs)

    monkeypatch.setattr(lean, "drf_view", spy)
    return calls


def send(client: APIClient, workspace_id: Any, body: Any, **extra: Any) -> Any:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.generic("POST", url(workspace_id), raw, content_type="application/json", **extra)


def answer(response: Any) -> tuple[int, bytes, dict[str, str]]:
    headers = {
        name: value
        for name, value in response.items()
        if name not in ("X-Request-ID", "Content-Length")
    }
    return response.status_code, response.content, headers


def both_ways(client: APIClient, workspace_id: Any, body: Any, **extra: Any) -> Any:
    """Send `body` down the lean path and through the DRF view; assert equal answers."""
    lean_response = send(client, workspace_id, body, **extra)
    with override_settings(PAPERCLIP_LEAN_CLAIM_VIEW=False):
        drf_response = send(client, workspace_id, body, **extra)
    assert answer(lean_response) == answer(drf_response)
    return lean_response


# --- created and renewed: the lean path, the serializers' JSON, the DRF view's headers ----


def test_created_and_renewed_are_served_by_the_lean_path_as_the_serializers_render(
    agent_client: APIClient, agent: Agent, workspace: Any, drf_calls: list[str]
) -> None:
    issue = IssueFactory(company=workspace.company)
    run = HeartbeatRunFactory(company=workspace.company, agent=agent)
    body = {"action": "start", "issue_id": str(issue.pk), "run_id": str(run.pk)}

    created = send(agent_client, workspace.pk, {**body, "ttl_seconds": 300})
    renewed = send(agent_client, workspace.pk, {**body, "action": "restart"})

    assert drf_calls == []
    assert created.status_code == renewed.status_code == 200
    assert created.json()["outcome"] == "created"
    assert renewed.json()["outcome"] == "renewed"
    assert renewed.json()["lease"]["generation"] == created.json()["lease"]["generation"]
    with override_settings(PAPERCLIP_LEAN_CLAIM_VIEW=False):
        through_drf = send(agent_client, workspace.pk, body)
    assert drf_calls == [url(workspace.pk)]
    assert through_drf.json()["outcome"] == "renewed"
    assert set(through_drf.json()) == set(renewed.json())
    assert set(through_drf.json()["lease"]) == set(renewed.json()["lease"])
    assert answer(renewed)[2] == answer(through_drf)[2]  # the same headers


@pytest.mark.parametrize("outcome", ["created", "renewed", "reclaimed"])
def test_the_lean_rendering_is_the_output_serializers(
    agent: Agent, workspace: Any, outcome: str
) -> None:
    if outcome != "created":
        first = claim(
            workspace, agent if outcome == "renewed" else AgentFactory(company=agent.company)
        )
        assert first.outcome == "created"
        if outcome == "reclaimed":
            expire(workspace)
    result = claim(workspace, agent)
    assert result.outcome == outcome
    expected = RuntimeLeaseClaimApi.OutputSerializer().to_representation(result)
    assert lean.claim_json(result) == expected
    content = lean.render(lean.claim_json(result), 200).content
    assert content == json.dumps(expected, separators=(",", ":")).encode()


def test_the_lean_keys_are_the_output_serializers() -> None:
    assert lean.lean_keys_mismatch() is None


def test_a_field_added_to_the_serializer_only_is_never_dropped_by_the_lean_path(
    agent_client: APIClient, workspace: Any, drf_calls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guard on bad input: an OutputSerializer with a field the lean path does not render
    is reported (the test above then fails), and the claim goes to the DRF view, which renders
    the new field, instead of being answered without it."""

    class Wider(RuntimeLeaseClaimApi.OutputSerializer):
        expires_in = serializers.IntegerField(default=60)

    class WiderReclaimed(RuntimeLeaseClaimApi.OutputSerializer):
        class Reclaimed(RuntimeLeaseClaimApi.OutputSerializer.ReclaimedFromSerializer):
            reclaimed_at = serializers.DateTimeField(default=None)

        reclaimed_from = Reclaimed(allow_null=True)

    lean._lean_rendering_complete.cache_clear()
    try:
        monkeypatch.setattr(RuntimeLeaseClaimApi, "OutputSerializer", WiderReclaimed)
        assert "reclaimed_at" in (lean.lean_keys_mismatch() or "")
        monkeypatch.setattr(RuntimeLeaseClaimApi, "OutputSerializer", Wider)
        assert "expires_in" in (lean.lean_keys_mismatch() or "")
        response = send(agent_client, workspace.pk, {"action": "start"})
        assert response.status_code == 200
        assert response.json()["expires_in"] == 60
        assert drf_calls == [url(workspace.pk)]
    finally:
        lean._lean_rendering_complete.cache_clear()


# --- every error the endpoint gives: the same answer both ways ----------------------------

BAD_BODIES = [
    pytest.param(b"{", id="bad-json"),
    pytest.param(b"\xff", id="not-utf8"),
    pytest.param(b"[]", id="not-an-object"),
    pytest.param(b"{}", id="action-missing"),
    pytest.param({"action": "start", "extra": 1}, id="unknown-field"),
    pytest.param({"action": 1}, id="action-number"),
    pytest.param({"action": "fly"}, id="action-unknown"),
    pytest.param({"action": "start", "ttl_seconds": "300"}, id="ttl-text"),
    pytest.param({"action": "start", "ttl_seconds": True}, id="ttl-bool"),
    pytest.param({"action": "start", "ttl_seconds": 300.0}, id="ttl-float"),
    pytest.param({"action": "start", "ttl_seconds": 59}, id="ttl-too-short"),
    pytest.param({"action": "start", "ttl_seconds": 86401}, id="ttl-too-long"),
    pytest.param({"action": "start", "issue_id": 5}, id="issue-number"),
    pytest.param({"action": "start", "run_id": "{not-a-uuid}"}, id="run-not-uuid"),
    pytest.param({"action": "start\u0000"}, id="nul-in-value"),
    pytest.param({"action": "start", "a\u0000": 1}, id="nul-in-key"),
    pytest.param(b'{"action": "start", "x": "\\ud800"}', id="lone-surrogate"),
    pytest.param(b'{"action": "start", "ttl_seconds": NaN}', id="nan"),
    pytest.param(
        {
            "action": "start",
            "deep": [
                [
                    [
                        [
                            [
                                [
                                    [
                                        [
                                            [
                                                [
                                                    [
                                                        [
                                                            [
                                                                [
                                                                    [
                                                                        [
                                                                            [
                                                                                [
                                                                                    [
                                                                                        [
                                                                                            [
                                                                                                [
                                                                                                    [
                                                                                                        [
                                                                                                            [
                                                                                                                [
                                                                                                                    [
                                                                                                                        [
                                                                                                                            [
                                                                                                                                [
                                                                                                                                    [
                                                                                                                                        [
                                                                                                                                            [
                                                                                                                                                [
                                                                                                                                                    [
                                                                                                                                                        [
                                                                                                                                                            [
                                                                                                                                                                [
                                                                                                                                                                    [
                                                                                                                                                                        [
                                                                                                                                                                            [
                                                                                                                                                                                [
                                                                                                                                                                                    [
                                                                                                                                                                                        [
                                                                                                                                                                                            [
                                                                                                                                                                                                [
                                                                                                                                                                                                    [
                                                                                                                                                                                                        [
                                                                                                                                                                                                            [
                                                                                                                                                                                                                [
                                                                                                                                                                                                                    [
                                                                                                                                                                                                                        [
                                                                                                                                                                                                                            [
                                                                                                                                                                                                                                [
                                                                                                                                                                                                                                    [
                                                                                                                                                                                                                                        [
                                                                                                                                                                                                                                            [
                                                                                                                                                                                                                                                [
                                                                                                                                                                                                                                                    [
                                                                                                                                                                                                                                                        [
                                                                                                                                                                                                                                                            [
                                                                                                                                                                                                                                                                [
                                                                                                                                                                                                                                                                    [
                                                                                                                                                                                                                                                                        [
                                                                                                                                                                                                                                                                            [
                                                                                                                                                                                                                                                                                [
                                                                                                                                                                                                                                                                                    []
                                                                                                                                                                                                                                                                                ]
                                                                                                                                                                                                                                                                            ]
                                                                                                                                                                                                                                                                        ]
                                                                                                                                                                                                                                                                    ]
                                                                                                                                                                                                                                                                ]
                                                                                                                                                                                                                                                            ]
                                                                                                                                                                                                                                                        ]
                                                                                                                                                                                                                                                    ]
                                                                                                                                                                                                                                                ]
                                                                                                                                                                                                                                            ]
                                                                                                                                                                                                                                        ]
                                                                                                                                                                                                                                    ]
                                                                                                                                                                                                                                ]
                                                                                                                                                                                                                            ]
                                                                                                                                                                                                                        ]
                                                                                                                                                                                                                    ]
                                                                                                                                                                                                                ]
                                                                                                                                                                                                            ]
                                                                                                                                                                                                        ]
                                                                                                                                                                                                    ]
                                                                                                                                                                                                ]
                                                                                                                                                                                            ]
                                                                                                                                                                                        ]
                                                                                                                                                                                    ]
                                                                                                                                                                                ]
                                                                                                                                                                            ]
                                                                                                                                                                        ]
                                                                                                                                                                    ]
                                                                                                                                                                ]
                                                                                                                                                            ]
                                                                                                                                                        ]
                                                                                                                                                    ]
                                                                                                                                                ]
                                                                                                                                            ]
                                                                                                                                        ]
                                                                                                                                    ]
                                                                                                                                ]
                                                                                                                            ]
                                                                                                                        ]
                                                                                                                    ]
                                                                                                                ]
                                                                                                            ]
                                                                                                        ]
                                                                                                    ]
                                                                                                ]
                                                                                            ]
                                                                                        ]
                                                                                    ]
                                                                                ]
                                                                            ]
                                                                        ]
                                                                    ]
                                                                ]
                                                            ]
                                                        ]
                                                    ]
                                                ]
                                            ]
                                        ]
                                    ]
                                ]
                            ]
                        ]
                    ]
                ]
            ],
        },
        id="too-deep",
    ),
]


@pytest.mark.parametrize("body", BAD_BODIES)
def test_a_malformed_body_is_refused_exactly_as_before(
    agent_client: APIClient, workspace: Any, drf_calls: list[str], body: Any
) -> None:
    response = both_ways(agent_client, workspace.pk, body)
    assert_error(response, 400, "invalid_request")
    assert url(workspace.pk) in drf_calls  # handed over: the DRF view names the fault


def test_another_companys_workspace_and_ids_are_404_exactly_as_before(
    agent_client: APIClient, workspace: Any, other_company: Any
) -> None:
    foreign = ExecutionWorkspaceFactory(company=other_company)
    assert_error(both_ways(agent_client, foreign.pk, {"action": "start"}), 404, "not_found")
    assert_error(both_ways(agent_client, uuid.uuid4(), {"action": "start"}), 404, "not_found")
    foreign_issue = IssueFactory(company=other_company)
    response = both_ways(
        agent_client, workspace.pk, {"action": "start", "issue_id": str(foreign_issue.pk)}
    )
    assert response.status_code == 404
    assert not ActivityEvent.objects.filter(action__startswith="runtime_lease.").exists()


def test_conflicts_and_an_ineligible_owner_are_refused_exactly_as_before(
    agent: Agent, workspace: Any, make_agent_client: Any, drf_calls: list[str]
) -> None:
    rival = AgentFactory(company=workspace.company)
    claim(workspace, rival)
    response = both_ways(make_agent_client(agent), workspace.pk, {"action": "stop"})
    assert_error(response, 409, "workspace_runtime_lease_conflict")
    assert response.json()["error"]["remediation"]
    assert drf_calls == [url(workspace.pk)]  # only the DRF-view request: the lean one was lean

    done = IssueFactory(company=workspace.company, status="done")
    response = both_ways(
        make_agent_client(agent), workspace.pk, {"action": "start", "issue_id": str(done.pk)}
    )
    assert_error(response, 409, "workspace_runtime_lease_owner_ineligible")


def test_a_foreign_run_is_403_exactly_as_before(agent_client: APIClient, workspace: Any) -> None:
    run = HeartbeatRunFactory(
        company=workspace.company, agent=AgentFactory(company=workspace.company)
    )
    response = both_ways(agent_client, workspace.pk, {"action": "start", "run_id": str(run.pk)})
    assert response.status_code == 403


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer pcak_zz.secret", "Bearer pcak_abcdef.wrong", "Basic dXNlcjpwYXNz"],
    ids=["none", "malformed", "unknown", "other-scheme"],
)
def test_unauthenticated_is_401_exactly_as_before(
    workspace: Any, authorization: str | None
) -> None:
    client = APIClient()
    if authorization is not None:
        client.credentials(HTTP_AUTHORIZATION=authorization)
    response = both_ways(client, workspace.pk, {"action": "start"})
    assert_error(response, 401, "not_authenticated")
    assert response["WWW-Authenticate"].startswith("Bearer")


def test_a_revoked_key_is_refused_on_the_next_request(agent: Agent, workspace: Any) -> None:
    """Nothing caches authentication: the request right after the revocation is refused."""
    issued = agent_key_create(agent_id=agent.pk)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {issued.secret}")
    assert send(client, workspace.pk, {"action": "start"}).status_code == 200
    assert send(client, workspace.pk, {"action": "start"}).json()["outcome"] == "renewed"

    agent_key_revoke(key_id=issued.id, actor_type="system", actor_id="test")

    assert_error(both_ways(client, workspace.pk, {"action": "start"}), 401, "not_authenticated")
    Agent.objects.filter(pk=agent.pk).update(status=Agent.Status.TERMINATED)
    other = agent_key_create(agent_id=agent.pk)
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {other.secret}")
    assert_error(both_ways(client, workspace.pk, {"action": "start"}), 401, "not_authenticated")


def test_other_requests_are_handed_to_the_drf_view(
    agent_client: APIClient, board_client: APIClient, workspace: Any, drf_calls: list[str]
) -> None:
    path = url(workspace.pk)
    board = board_client.post(path, {"action": "start"}, format="json")
    assert board.json()["outcome"] == "bypassed"
    assert agent_client.post(path + "?x=1", {"action": "start"}, format="json").status_code == 200
    assert (
        send(agent_client, workspace.pk, {"action": "start"}, HTTP_ACCEPT="text/html").status_code
        == 406
    )
    assert (
        agent_client.generic("POST", path, "action=start", content_type="text/plain").status_code
        == 415
    )
    assert agent_client.get(path).status_code == 405
    assert len(drf_calls) == 5


# --- audit, metrics and the request log line ----------------------------------------------


def test_one_audit_row_for_a_create_none_for_renews_or_refusals(
    agent_client: APIClient, workspace: Any, make_agent_client: Any, drf_calls: list[str]
) -> None:
    for _ in range(3):
        assert send(agent_client, workspace.pk, {"action": "start"}).status_code == 200
    rival = make_agent_client(AgentFactory(company=workspace.company))
    assert send(rival, workspace.pk, {"action": "stop"}).status_code == 409
    assert drf_calls == []
    actions = list(
        ActivityEvent.objects.filter(action__startswith="runtime_lease.").values_list(
            "action", flat=True
        )
    )
    assert actions == ["runtime_lease.created"]


def test_metrics_and_the_request_log_line_are_the_drf_views(
    agent: Agent,
    agent_client: APIClient,
    workspace: Any,
    request_lines: list[logging.LogRecord],
    django_capture_on_commit_callbacks: Any,
) -> None:
    route = "runtime-lease-claim"
    claim(workspace, agent)

    def counters() -> tuple[float, ...]:
        return (
            sample("paperclip_runtime_lease_claims_total", outcome="renewed"),
            sample("paperclip_http_requests_total", route=route, method="POST", status="200"),
            sample("paperclip_http_request_duration_seconds_count", route=route, method="POST"),
            sample("paperclip_api_errors_total", code="invalid_request", status="400"),
        )

    def both() -> None:
        assert send(agent_client, workspace.pk, {"action": "start"}).status_code == 200
        assert send(agent_client, workspace.pk, {"action": 7}).status_code == 400

    deltas, lines = each_way(
        "PAPERCLIP_LEAN_CLAIM_VIEW",
        both,
        counters=counters,
        request_lines=request_lines,
        on_commit=django_capture_on_commit_callbacks,
    )
    assert deltas[0] == deltas[1] == (1.0, 1.0, 2.0, 1.0)
    assert lines[0] == lines[1]
    assert [entry[1]["status"] for entry in lines[0]] == [200, 400]


# --- the lean validation is the serializer's on the bodies it takes ------------------------

VALID = [
    {"action": "start"},
    {"action": "repair", "ttl_seconds": 60},
    {"action": "stop", "ttl_seconds": 86400, "issue_id": None, "run_id": None},
    {"action": "restart", "issue_id": str(uuid.uuid4()).upper(), "ttl_seconds": None},
    {"action": "start", "run_id": str(uuid.uuid4())},
]


@pytest.mark.parametrize(
    "data", VALID + [p.values[0] for p in BAD_BODIES if isinstance(p.values[0], dict)]
)
def test_plain_values_are_what_the_serializer_validates(data: dict[str, Any]) -> None:
    serializer: type[StrictInputSerializer] = RuntimeLeaseClaimApi.InputSerializer
    plain = lean.plain_claim_values(data)
    try:
        expected = validated_body(serializer, data)
    except Exception:
        assert plain is None
    else:
        assert plain == expected


def test_the_schema_still_comes_from_the_drf_view() -> None:
    assert lean.runtime_lease_claim_view.cls is RuntimeLeaseClaimApi  # type: ignore[attr-defined]
