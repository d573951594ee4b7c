"""One body rule on every endpoint (docs/api.md#strict-bodies): hostile JSON, unknown keys and
wrong JSON types are a 400 naming the field, never a 500, and change nothing."""

from __future__ import annotations

import inspect
import uuid
from typing import Any

import pytest
from django.apps import apps
from django.urls import URLPattern, URLResolver, get_resolver
from rest_framework import serializers
from rest_framework.test import APIClient
from rest_framework.views import APIView

from leases.models import WorkspaceRuntimeLease
from paperclip.api.parsers import MAX_DEPTH, StrictJSONParser
from paperclip.api.serializers import StrictInputSerializer
from paperclip.models import (
    ActivityEvent,
    NativeRunFinalization,
    NativeRunResult,
    WorkspaceOperation,
)
from tests.helpers import assert_error
from tests.paperclip.factories import ExecutionWorkspaceFactory, IssueFactory
from tests.recovery.factories import make_binding

pytestmark = pytest.mark.django_db


def _raw(client: APIClient, url: str, body: str | bytes, content_type: str = "application/json"):
    return client.post(url, body, content_type=content_type)


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _fields(response: Any) -> dict[str, Any]:
    return assert_error(response, 400, "invalid_request")["details"]["fields"]


def _snapshot() -> tuple[int, ...]:
    return (
        ActivityEvent.objects.count(),
        NativeRunResult.objects.count(),
        WorkspaceRuntimeLease.objects.count(),
        WorkspaceOperation.objects.count(),
    )


def test_hostile_json_is_a_400_even_without_credentials() -> None:
    url = "/api/platform/worker-stops"
    before = _snapshot()
    assert "body" in _fields(_raw(APIClient(), url, _nested(100_000)))
    assert "body" in _fields(_raw(APIClient(), url, b'{"run_id": "\xff"}'))
    assert "body" in _fields(_raw(APIClient(), url, "{not json"))
    latin = _raw(APIClient(), url, "{}", "application/json; charset=latin-1")
    assert "charset" in _fields(latin)["body"][0]
    assert _snapshot() == before


@pytest.mark.parametrize(
    ("result", "where", "message"),
    [
        ('{"log": "a\\u0000b"}', "result.log", "NUL"),
        ('{"k\\u0000": 1}', "result", "NUL"),
        ('{"log": "\\ud800"}', "result.log", "surrogate"),
        ('{"lines": [1, 2, 1e999]}', "result.lines[2]", "not valid JSON"),
        ('{"x": NaN}', "result.x", "not valid JSON"),
        ('{"x": -Infinity}', "result.x", "not valid JSON"),
        (_nested(MAX_DEPTH), "result", "Nested deeper"),
    ],
)
def test_what_jsonb_cannot_store_is_a_400_naming_where(
    make_agent_client: Any, result: str, where: str, message: str
) -> None:
    b = make_binding(with_result=False)
    body = '{"result": ' + result + ', "terminal": {"run_terminal_state": "succeeded"}}'
    client = make_agent_client(b.agent)
    before = _snapshot()
    response = _raw(client, f"/api/heartbeat-runs/{b.run.pk}/results", body)
    fields = _fields(response)
    # Number parsing stops the whole parse, so those name the body; the rest name the place.
    place = "body" if message == "not valid JSON" else where
    [(named, [text])] = fields.items()
    assert named.startswith(place), fields
    assert message in text
    assert _snapshot() == before


def _objects(levels: int) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for _ in range(levels - 1):
        nested = {"a": nested}
    return nested


def test_the_depth_limit_counts_the_body_itself(make_agent_client: Any) -> None:
    b = make_binding(with_result=False)
    NativeRunFinalization.objects.filter(run_id=b.run.pk).delete()  # no result yet
    client, url = make_agent_client(b.agent), f"/api/heartbeat-runs/{b.run.pk}/results"
    terminal = {"run_terminal_state": "succeeded"}
    # The body is level 1, `result` level 2: 63 levels of result fit, 64 do not.
    deep = client.post(url, {"result": _objects(MAX_DEPTH), "terminal": terminal}, format="json")
    assert "Nested deeper" in next(iter(_fields(deep).values()))[0]
    fits = {"result": _objects(MAX_DEPTH - 1), "terminal": terminal}
    assert client.post(url, fits, format="json").status_code == 201


def test_a_lone_surrogate_in_a_choice_or_a_key_is_a_400_not_a_500(agent_client: Any) -> None:
    workspace = ExecutionWorkspaceFactory(company=agent_client_company(agent_client))
    url = f"/api/execution-workspaces/{workspace.pk}/runtime-lease/claim"
    assert "action" in _fields(_raw(agent_client, url, '{"action": "\\ud800"}'))
    assert "body" in _fields(_raw(agent_client, url, '{"action": "start", "\\udfff": 1}'))
    assert not WorkspaceRuntimeLease.objects.exists()


def agent_client_company(client: Any) -> Any:
    me = client.get("/api/me").json()
    from paperclip.models import Company

    return Company.objects.get(pk=me["company_ids"][0])


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"action": "start", "ttl_seconds": "60"}, "ttl_seconds"),
        ({"action": "start", "ttl_seconds": 60.0}, "ttl_seconds"),
        ({"action": "start", "ttl_seconds": True}, "ttl_seconds"),
        ({"action": 1}, "action"),
        ({"action": "start", "force": 1}, "force"),
    ],
)
def test_wrong_json_types_and_unknown_keys_are_400(
    agent_client: Any, body: Any, field: str
) -> None:
    workspace = ExecutionWorkspaceFactory(company=agent_client_company(agent_client))
    url = f"/api/execution-workspaces/{workspace.pk}/runtime-lease/claim"
    assert field in _fields(agent_client.post(url, body, format="json"))
    assert not WorkspaceRuntimeLease.objects.exists()


def test_a_number_is_not_text_on_a_fenced_write(agent_client: Any) -> None:
    company = agent_client_company(agent_client)
    workspace = ExecutionWorkspaceFactory(company=company)
    issue = IssueFactory(company=company)
    claim = agent_client.post(
        f"/api/execution-workspaces/{workspace.pk}/runtime-lease/claim",
        {"action": "start", "issue_id": str(issue.pk)},
        format="json",
    ).json()
    url = f"/api/execution-workspaces/{workspace.pk}/operations"
    body = {
        "generation": claim["lease"]["generation"],
        "issue_id": str(issue.pk),
        "phase": 0,
        "status": "running",
    }
    assert "phase" in _fields(agent_client.post(url, body, format="json"))
    assert not WorkspaceOperation.objects.exists()


# --- the mechanism covers every endpoint -----------------------------------------------------


def _views(patterns: list[Any] | None = None) -> list[type[APIView]]:
    found: list[type[APIView]] = []
    for entry in patterns if patterns is not None else get_resolver().url_patterns:
        if isinstance(entry, URLResolver):
            found += _views(entry.url_patterns)
        elif isinstance(entry, URLPattern):
            view = getattr(entry.callback, "view_class", None) or getattr(
                entry.callback, "cls", None
            )
            if inspect.isclass(view) and issubclass(view, APIView):
                found.append(view)
    return found


def _input_serializers(view: type[APIView]) -> list[type[serializers.Serializer[Any]]]:
    return [
        value
        for name, value in vars(view).items()
        if (
            inspect.isclass(value) and issubclass(value, serializers.Serializer) and "Input" in name
        )
        or (inspect.isclass(value) and name == "InputSerializer")
    ]


def _nested_serializers(serializer: type[serializers.Serializer[Any]]) -> list[Any]:
    out = []
    for field in serializer().fields.values():
        child = getattr(field, "child", field)
        if isinstance(child, serializers.Serializer):
            out.append(type(child))
            out += _nested_serializers(type(child))
    return out


def test_every_api_view_parses_strictly_and_every_body_serializer_is_strict() -> None:
    views = _views()
    assert len(views) > 20
    offenders = []
    for view in views:
        if [type(p) for p in view().get_parsers()] != [StrictJSONParser]:
            offenders.append(f"{view.__module__}.{view.__name__}: parsers")
        for serializer in _input_serializers(view):
            for each in (serializer, *_nested_serializers(serializer)):
                if not issubclass(each, StrictInputSerializer):
                    offenders.append(f"{view.__module__}.{view.__name__}: {each.__name__}")
    assert offenders == []


def test_no_endpoint_answers_a_500_to_hostile_bodies(
    make_agent_client: Any, make_board_client: Any
) -> None:
    """Every POST/PUT/PATCH route of the URL conf, as an agent and as a board member, with ids
    that exist nowhere: hostile bodies get a JSON 4xx, never a 5xx."""
    b = make_binding(with_result=False)
    clients = [make_agent_client(b.agent), make_board_client(b.company), APIClient()]
    bodies = [_nested(5000), '{"a": "\\u0000"}', '{"a": 1e999}', '{"\\ud800": 1}', "[]", "1"]
    routes = _write_routes()
    assert len(routes) > 15
    before = _all_rows()
    for route in routes:
        url = "/" + "".join(
            str(uuid.uuid4()) if part.endswith("_id") else part for part in _split_params(route)
        )
        for client in clients:
            for body in bodies:
                for method in ("post", "put", "patch"):
                    response = getattr(client, method)(url, body, content_type="application/json")
                    assert 400 <= response.status_code < 500, (method, url, body[:20])
                    assert response["Content-Type"].startswith("application/json"), url
                    assert set(response.json()) == {"error"}, url
    assert _all_rows() == before  # not one row written by any of them


def _all_rows() -> dict[str, int]:
    return {
        model._meta.label: model.objects.count()
        for model in apps.get_models()
        if model._meta.managed
        and model._meta.app_label in ("paperclip", "leases", "recovery", "checkpoints")
    }


def _split_params(route: str) -> list[str]:
    parts, rest = [], route
    while "<" in rest:
        head, _, tail = rest.partition("<")
        name, _, rest = tail.partition(">")
        parts += [head, name.split(":")[-1]]
    return [*parts, rest]


def _write_routes(patterns: list[Any] | None = None, prefix: str = "") -> list[str]:
    routes: list[str] = []
    for entry in patterns if patterns is not None else get_resolver().url_patterns:
        if isinstance(entry, URLResolver):
            routes += _write_routes(entry.url_patterns, prefix + str(entry.pattern))
        elif isinstance(entry, URLPattern):
            view = getattr(entry.callback, "view_class", None)
            writes = any(hasattr(view, m) for m in ("post", "put", "patch"))
            if inspect.isclass(view) and issubclass(view, APIView) and writes:
                routes.append(prefix + str(entry.pattern))
    return routes
