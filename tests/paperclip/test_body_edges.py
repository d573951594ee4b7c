"""Request bodies at their edges, through the WSGI application as a server calls it
(`paperclip.wsgi.application`, where bodies are prepared before Django): a Content-Length that
is not a number, a body cut short on the lean claim path, and a JSON object with a key twice.
Each is refused with nothing written, and the lean path answers as the DRF view does."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
from django.test import override_settings
from rest_framework.test import APIClient

from leases.models import WorkspaceRuntimeLease
from paperclip.api.parsers import parse_json_body
from paperclip.credentials import agent_key_create
from paperclip.errors import InvalidRequest
from paperclip.models import ActivityEvent, Agent
from paperclip.wsgi import application
from tests.helpers import assert_error
from tests.leases.factories import claim
from tests.paperclip.factories import ExecutionWorkspaceFactory

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def agent_key(agent: Agent) -> str:
    return agent_key_create(agent_id=agent.pk).secret


def call(
    path: str, body: bytes, *, length: str, authorization: str | None = None
) -> tuple[int, dict[str, str], dict[str, Any]]:
    """One POST through the WSGI application; its status, headers and JSON."""
    environ: dict[str, Any] = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": path,
        "QUERY_STRING": "",
        "SERVER_NAME": "testserver",
        "SERVER_PORT": "80",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "wsgi.url_scheme": "http",
        "wsgi.input": io.BytesIO(body),
        "wsgi.errors": io.StringIO(),
        "CONTENT_TYPE": "application/json",
        "CONTENT_LENGTH": length,
        "HTTP_ACCEPT": "application/json",
    }
    if authorization is not None:
        environ["HTTP_AUTHORIZATION"] = authorization
    answered: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]], *_: Any) -> None:
        answered["status"], answered["headers"] = int(status.split()[0]), dict(headers)

    content = b"".join(application(environ, start_response))
    return answered["status"], answered["headers"], json.loads(content) if content else {}


def test_a_content_length_that_is_not_a_number_is_400_and_releases_nothing(
    agent: Agent, agent_key: str
) -> None:
    """Read as an empty body, it made a release act for the key's owner (200, the lease gone,
    an audit row) instead of the issue the body named."""
    workspace = ExecutionWorkspaceFactory(company=agent.company)
    claim(workspace, agent)
    events = ActivityEvent.objects.count()
    status, _, body = call(
        f"/api/execution-workspaces/{workspace.pk}/runtime-lease/release",
        b'{"issue_id": "00000000-0000-4000-8000-000000000000"}',
        length="abc",
        authorization=f"Bearer {agent_key}",
    )
    assert (status, body["error"]["code"]) == (400, "invalid_request")
    assert ActivityEvent.objects.count() == events
    assert WorkspaceRuntimeLease.objects.filter(execution_workspace=workspace).exists()


@pytest.mark.parametrize("authorization", ["Bearer pcak_0123abcd.wrongsecret", "key"])
def test_a_body_cut_short_is_answered_by_the_lean_path_as_by_the_drf_view(
    agent: Agent, agent_key: str, authorization: str
) -> None:
    """The lean path read the body before anything else: a bad key got 400, not 401, and a
    good one a body and headers of another shape."""
    workspace = ExecutionWorkspaceFactory(company=agent.company)
    key = f"Bearer {agent_key}" if authorization == "key" else authorization
    path = f"/api/execution-workspaces/{workspace.pk}/runtime-lease/claim"
    lean = call(path, b'{"act', length="19", authorization=key)
    with override_settings(PAPERCLIP_LEAN_CLAIM_VIEW=False):
        drf = call(path, b'{"act', length="19", authorization=key)
    drop = ("X-Request-ID", "Content-Length")
    assert (lean[0], lean[2]) == (drf[0], drf[2])
    assert {k: v for k, v in lean[1].items() if k not in drop} == {
        k: v for k, v in drf[1].items() if k not in drop
    }
    assert lean[0] == (401 if authorization != "key" else 400)


def test_an_object_with_a_key_twice_is_refused(agent_client: APIClient) -> None:
    """The last key won here, where another parser keeps the first: two readers of one body
    saw two requests."""
    for twice in (
        b'{"leases": [], "leases": [{"kind": "runtime"}]}',
        b'{"a": {"kind": "runtime", "kind": "controller"}}',
    ):
        with pytest.raises(InvalidRequest) as refused:
            parse_json_body(twice)
        assert "twice" in str(refused.value.details)
    assert parse_json_body(b'{"a": {"b": 1}, "b": {"a": 2}}') == {"a": {"b": 1}, "b": {"a": 2}}
    response = agent_client.generic(
        "POST",
        "/api/leases/renew",
        b'{"leases": [], "leases": []}',
        content_type="application/json",
    )
    assert_error(response, 400, "invalid_request")
