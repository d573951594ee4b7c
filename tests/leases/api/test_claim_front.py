"""The claim endpoint served ahead of Django's handler (paperclip/api/front.py) answers
exactly as the handler and its middleware do.

Requests go through the project's real WSGI application (`paperclip.wsgi.application`, what
granian and gunicorn serve), once with the front and once with PAPERCLIP_FRONT_ROUTES=false
(every request through Django's handler and middleware chain), and the two answers must be
equal: status, body, every header but the request's id. The front must be the one answering
(Django's handler is made to fail), send Django's request signals once each, record the same
metrics and log line, and leave to the handler what the middleware would answer itself.
Behaviour only: nothing here measures time.
"""

from __future__ import annotations

import io
import json
import logging
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.core import signals
from django.core.handlers.wsgi import WSGIHandler
from django.db import close_old_connections
from django.middleware.security import SecurityMiddleware
from django.test import override_settings
from django.urls import resolve

import paperclip.wsgi
from leases.api import lean
from paperclip.api import front
from paperclip.credentials import agent_key_create, agent_key_revoke
from paperclip.models import ActivityEvent, Agent
from tests.helpers import each_way, sample
from tests.leases.factories import claim
from tests.paperclip.factories import AgentFactory, ExecutionWorkspaceFactory

pytestmark = pytest.mark.django_db

ROUTE = "runtime-lease-claim"
CONFLICT = "workspace_runtime_lease_conflict"
Answer = tuple[str, list[tuple[str, str]], bytes]


@pytest.fixture(autouse=True)
def in_test_transaction() -> Iterator[None]:
    """As Django's test client does: the request signals must not close the connection that
    holds the test's transaction."""
    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    try:
        yield
    finally:
        signals.request_started.connect(close_old_connections)
        signals.request_finished.connect(close_old_connections)


@pytest.fixture
def secret(agent: Agent) -> str:
    return agent_key_create(agent_id=agent.pk).secret


def path(workspace_id: Any) -> str:
    return f"/api/execution-workspaces/{workspace_id}/runtime-lease/claim"


def call(
    target: str,
    secret: str,
    body: Any,
    *,
    method: str = "POST",
    **environ: Any,
) -> Answer:
    """One request through `paperclip.wsgi.application`, as a WSGI server makes it."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    env: dict[str, Any] = {
        "REQUEST_METHOD": method,
        "PATH_INFO": target,
        "SCRIPT_NAME": "",
        "QUERY_STRING": "",
        "SERVER_NAME": "testserver",
        "SERVER_PORT": "80",
        "HTTP_HOST": "testserver",
        "HTTP_AUTHORIZATION": f"Bearer {secret}",
        "CONTENT_TYPE": "application/json",
        "CONTENT_LENGTH": str(len(raw)),
        "REMOTE_ADDR": "127.0.0.1",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "wsgi.input": io.BytesIO(raw),
        "wsgi.url_scheme": "http",
        "wsgi.errors": sys.stderr,
        **environ,
    }
    started: list[tuple[str, list[tuple[str, str]]]] = []

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        started.append((status, headers))

    result = paperclip.wsgi.application(env, start_response)
    try:
        content = b"".join(result)
    finally:
        close = getattr(result, "close", None)
        if close is not None:
            close()
    (status, headers), *_ = started
    return status, headers, content


def comparable(answer: Answer) -> Answer:
    status, headers, content = answer
    return status, sorted((k, v) for k, v in headers if k != "X-Request-ID"), content


@pytest.fixture
def handler_fails(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """Make Django's handler unusable: what still answers is the front."""

    def arm() -> None:
        def refuse(environ: Any, start_response: Any) -> Any:
            raise AssertionError(f"Django's handler was asked: {environ['PATH_INFO']}")

        monkeypatch.setattr(paperclip.wsgi, "django_application", refuse)

    return arm


def both_ways(target: str, secret: str, body: Any, **environ: Any) -> Answer:
    """The same request with the front and through the handler: equal answers (for a
    successful claim, whose times move, the same outcome and fields)."""
    ahead = call(target, secret, body, **environ)
    with override_settings(PAPERCLIP_FRONT_ROUTES=False):
        behind = call(target, secret, body, **environ)
    if ahead[0] == behind[0] == "200 OK":
        assert comparable(ahead)[:2] == comparable(behind)[:2] or _lengths_only(ahead, behind)
        assert json.loads(ahead[2]).keys() == json.loads(behind[2]).keys()
    else:
        assert comparable(ahead) == comparable(behind)
    return ahead


def _lengths_only(a: Answer, b: Answer) -> bool:
    """Headers equal but for Content-Length (a created claim's JSON against a renewed one)."""
    return [h for h in comparable(a)[1] if h[0] != "Content-Length"] == [
        h for h in comparable(b)[1] if h[0] != "Content-Length"
    ]


@pytest.fixture
def handler_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The requests Django's handler answered (by path)."""
    calls: list[str] = []
    real = paperclip.wsgi.django_application

    def spy(environ: Any, start_response: Any) -> Any:
        calls.append(environ["PATH_INFO"])
        return real(environ, start_response)

    monkeypatch.setattr(paperclip.wsgi, "django_application", spy)
    return calls


# --- the front answers, as the handler would ------------------------------------------------


def test_created_and_renewed_are_answered_by_the_front_with_the_handlers_headers(
    agent: Agent, workspace: Any, secret: str, handler_fails: Callable[[], None]
) -> None:
    with override_settings(PAPERCLIP_FRONT_ROUTES=False):
        through_handler = call(path(workspace.pk), secret, {"action": "start"})
    handler_fails()
    renewed = call(path(workspace.pk), secret, {"action": "start"})

    assert renewed[0] == through_handler[0] == "200 OK"
    assert json.loads(through_handler[2])["outcome"] == "created"
    assert json.loads(renewed[2])["outcome"] == "renewed"
    names = [name for name, _ in renewed[1]]
    assert sorted(names) == sorted(name for name, _ in through_handler[1])
    # What the middleware chain adds, added here too.
    headers = dict(renewed[1])
    assert headers["X-Frame-Options"] == "DENY"
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert headers["Content-Length"] == str(len(renewed[2]))
    assert len(headers["X-Request-ID"]) == 32
    assert {k: v for k, v in renewed[1] if k not in ("X-Request-ID", "Content-Length")} == {
        k: v for k, v in through_handler[1] if k not in ("X-Request-ID", "Content-Length")
    }


def test_an_upstream_request_id_is_kept(
    workspace: Any, secret: str, handler_fails: Callable[[], None]
) -> None:
    handler_fails()
    _, headers, _ = call(path(workspace.pk), secret, {"action": "start"}, HTTP_X_REQUEST_ID="lb-7")
    assert dict(headers)["X-Request-ID"] == "lb-7"


def test_refusals_by_the_service_are_the_handlers_answers(
    agent: Agent, workspace: Any, secret: str
) -> None:
    claim(workspace, AgentFactory(company=agent.company))  # another owner holds it
    conflict = both_ways(path(workspace.pk), secret, {"action": "start"})
    assert conflict[0].startswith("409")
    theirs = ExecutionWorkspaceFactory()
    hidden = both_ways(path(theirs.pk), secret, {"action": "start"})
    assert hidden[0].startswith("404")
    assert json.loads(hidden[2])["error"]["code"] == "not_found"


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"{", id="bad-json"),
        pytest.param({"action": "fly"}, id="unknown-action"),
        pytest.param({"action": "start", "extra": 1}, id="unknown-field"),
        pytest.param({"action": "start", "ttl_seconds": 5}, id="ttl-too-short"),
    ],
)
def test_a_body_the_front_declines_reaches_the_drf_view_whole(
    workspace: Any, secret: str, body: Any
) -> None:
    status, _, content = both_ways(path(workspace.pk), secret, body)
    assert status.startswith("400")
    assert json.loads(content)["error"]["code"] == "invalid_request"


def test_a_revoked_key_is_refused_on_the_next_request(
    agent: Agent, workspace: Any, secret: str
) -> None:
    assert call(path(workspace.pk), secret, {"action": "start"})[0] == "200 OK"
    agent_key_revoke(key_id=agent.api_keys.get().pk, actor_type="system", actor_id="test")
    status, _, content = both_ways(path(workspace.pk), secret, {"action": "start"})
    assert status.startswith("401")
    assert json.loads(content)["error"]["code"] == "not_authenticated"


@pytest.mark.parametrize(
    ("target", "extra"),
    [
        pytest.param(None, {"HTTP_HOST": "evil.example"}, id="disallowed-host"),
        pytest.param(None, {"QUERY_STRING": "x=1"}, id="query-string"),
        pytest.param(None, {"HTTP_ACCEPT": "text/html"}, id="other-accept"),
        pytest.param("upper", {}, id="uppercase-uuid-no-route"),
        pytest.param("slash", {}, id="trailing-slash-no-route"),
        pytest.param(None, {"CONTENT_LENGTH": "5000"}, id="large-body"),
        pytest.param(None, {"HTTP_USER_AGENT": "BadBot/1"}, id="disallowed-user-agent"),
    ],
)
def test_what_the_middleware_or_the_url_conf_would_answer_goes_to_the_handler(
    workspace: Any, secret: str, target: str | None, extra: dict[str, str], handler_calls: list[str]
) -> None:
    url = path(workspace.pk)
    if target == "upper":
        url = path(str(workspace.pk).upper())
    elif target == "slash":
        url += "/"
    body: dict[str, Any] = {"action": "start"}
    if extra.get("CONTENT_LENGTH") == "5000":
        body = {"action": "start", "pad": "x" * 4990}
        extra = {}
    with override_settings(DISALLOWED_USER_AGENTS=[re.compile("BadBot")]):
        both_ways(url, secret, body, **extra)
    assert handler_calls == [url, url]  # both times: the front left it to the handler


def test_https_redirect_and_hsts_as_the_security_middleware_sets_them(
    workspace: Any, secret: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with override_settings(SECURE_SSL_REDIRECT=True, SECURE_HSTS_SECONDS=3600):
        # Middleware reads its settings when built: build both paths' afresh under these.
        monkeypatch.setattr(front, "_SECURITY", SecurityMiddleware(front._never))
        monkeypatch.setattr(paperclip.wsgi, "django_application", WSGIHandler())
        redirected = both_ways(path(workspace.pk), secret, {"action": "start"})
        assert redirected[0].startswith("301")
        secure = both_ways(
            path(workspace.pk), secret, {"action": "start"}, **{"wsgi.url_scheme": "https"}
        )
    assert secure[0] == "200 OK"
    assert dict(secure[1])["Strict-Transport-Security"] == "max-age=3600"


def test_an_exception_in_the_view_is_answered_as_the_handler_answers_it(
    workspace: Any, secret: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(result: Any) -> Any:
        raise RuntimeError("a bug in the rendering")

    monkeypatch.setattr(lean, "claim_json", broken)
    status, _, content = both_ways(path(workspace.pk), secret, {"action": "start"})
    assert status.startswith("500")
    assert json.loads(content)["error"]["code"] == "internal_error"


# --- signals, audit, metrics, log line ------------------------------------------------------


def test_the_request_signals_are_sent_once_each(
    workspace: Any, secret: str, handler_fails: Callable[[], None]
) -> None:
    sent: list[str] = []

    def on_started(**kwargs: Any) -> None:
        sent.append("started")

    def on_finished(**kwargs: Any) -> None:
        sent.append("finished")

    signals.request_started.connect(on_started)
    signals.request_finished.connect(on_finished)
    try:
        handler_fails()
        assert call(path(workspace.pk), secret, {"action": "start"})[0] == "200 OK"
    finally:
        signals.request_started.disconnect(on_started)
        signals.request_finished.disconnect(on_finished)
    assert sent == ["started", "finished"]


def test_audit_metrics_and_the_log_line_are_the_handlers(
    agent: Agent,
    workspace: Any,
    secret: str,
    request_lines: list[logging.LogRecord],
    django_capture_on_commit_callbacks: Any,
) -> None:
    def counters() -> tuple[float, ...]:
        return (
            sample("paperclip_runtime_lease_claims_total", outcome="renewed"),
            sample("paperclip_http_requests_total", route=ROUTE, method="POST", status="200"),
            sample("paperclip_http_request_duration_seconds_count", route=ROUTE, method="POST"),
            sample(
                "paperclip_api_errors_total", code="workspace_runtime_lease_conflict", status="409"
            ),
        )

    rival = AgentFactory(company=agent.company)
    other = ExecutionWorkspaceFactory(company=agent.company)
    claim(other, rival)
    claim(workspace, agent)
    audit_rows = ActivityEvent.objects.count()

    def send() -> None:
        assert call(path(workspace.pk), secret, {"action": "start"})[0] == "200 OK"
        assert call(path(other.pk), secret, {"action": "start"})[0].startswith("409")

    deltas, lines = each_way(
        "PAPERCLIP_FRONT_ROUTES",
        send,
        counters=counters,
        request_lines=request_lines,
        on_commit=django_capture_on_commit_callbacks,
    )
    assert deltas[0] == deltas[1] == (1.0, 1.0, 2.0, 1.0)
    assert lines[0] == lines[1]
    assert [entry[1]["status"] for entry in lines[0]] == [200, 409]
    assert lines[0][0][1]["workspace_id"] == str(workspace.pk)
    assert ActivityEvent.objects.count() == audit_rows  # renews and refusals write nothing


def test_another_middleware_chain_turns_the_front_off(
    workspace: Any, secret: str, handler_calls: list[str]
) -> None:
    from django.conf import settings

    assert tuple(settings.MIDDLEWARE) == front.MIRRORED_MIDDLEWARE
    extra = [*settings.MIDDLEWARE, "django.middleware.gzip.GZipMiddleware"]
    with override_settings(MIDDLEWARE=extra):
        assert call(path(workspace.pk), secret, {"action": "start"})[0] == "200 OK"
    assert handler_calls == [path(workspace.pk)]
    assert call(path(workspace.pk), secret, {"action": "start"})[0] == "200 OK"
    assert handler_calls == [path(workspace.pk)]  # the front again


# --- the registration is the URL conf's ------------------------------------------------------


def test_the_front_route_is_the_url_confs(workspace: Any) -> None:
    match = resolve(path(workspace.pk))
    assert match.url_name == lean.FRONT_ROUTE.route == ROUTE
    assert match.func is lean.runtime_lease_claim_view
    assert lean.FRONT_ROUTE.view is lean.lean_claim
    assert lean.FRONT_ROUTE in front._ROUTES
    samples = [
        path(workspace.pk),
        path(str(workspace.pk).upper()),
        path(workspace.pk) + "/",
        path("not-a-uuid"),
        "/api/execution-workspaces//runtime-lease/claim",
        f"/api/execution-workspaces/{workspace.pk}/runtime-lease",
    ]
    for sample_path in samples:
        try:
            resolved = resolve(sample_path).url_name == ROUTE
        except Exception:
            resolved = False
        assert bool(lean.FRONT_ROUTE.pattern.fullmatch(sample_path)) == resolved, sample_path
