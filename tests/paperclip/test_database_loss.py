"""A request whose database connection dies mid-way answers 503 `database_unavailable` with
Retry-After (never a 500), changes nothing, and the next request works; an unexpected error is
the JSON 500 body even with DEBUG on. Console pages too answer 503 on a lost database."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from django.db import connection
from django.test import override_settings
from rest_framework.test import APIClient

from leases.models import WorkspaceRuntimeLease
from paperclip.models import ActivityEvent
from tests.helpers import assert_error, raw_connection
from tests.leases.factories import claim
from tests.paperclip.factories import AgentFactory, ExecutionWorkspaceFactory, IssueFactory
from tests.support.servers import free_port

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.embedded]


def _terminate_the_waiter(stop: threading.Event, done: list[int]) -> None:
    with raw_connection() as admin:
        while not stop.is_set():
            row = admin.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid() LIMIT 1"
            ).fetchone()
            if row:
                admin.execute("SELECT pg_terminate_backend(%s)", [row[0]])
                done.append(row[0])
                return
            time.sleep(0.02)


def test_a_request_whose_backend_is_terminated_answers_503_and_the_next_one_works(
    make_agent_client: Any,
) -> None:
    agent = AgentFactory()
    workspace = ExecutionWorkspaceFactory(company=agent.company)
    issue = IssueFactory(company=agent.company)
    claim(workspace, agent, issue_id=issue.pk)
    client = make_agent_client(agent)
    url = f"/api/execution-workspaces/{workspace.pk}/runtime-lease/claim"
    body = {"action": "start", "issue_id": str(issue.pk)}
    before = (ActivityEvent.objects.count(), WorkspaceRuntimeLease.objects.get().renewed_at)
    stop, terminated = threading.Event(), []
    with raw_connection(autocommit=False) as holder:
        # Hold the lease row so that the renew waits on its lock, then end its session.
        holder.execute(
            "SELECT 1 FROM execution_workspace_runtime_leases WHERE id = %s FOR UPDATE",
            [WorkspaceRuntimeLease.objects.get().pk],
        )
        killer = threading.Thread(target=_terminate_the_waiter, args=(stop, terminated))
        killer.start()
        try:
            response = client.post(url, body, format="json")
        finally:
            stop.set()
            killer.join()
        holder.rollback()
    assert terminated, "the renew never waited on the lock"
    error = assert_error(response, 503, "database_unavailable")
    assert response["Retry-After"] == "2"
    assert error["remediation"]
    connection.close()  # the test's own handle shared that backend
    assert (ActivityEvent.objects.count(), WorkspaceRuntimeLease.objects.get().renewed_at) == before
    again = client.post(url, body, format="json")
    assert again.status_code == 200, again.json()
    assert again.json()["outcome"] == "renewed"


@override_settings(DEBUG=True)
def test_an_unexpected_error_is_the_json_500_body_even_with_debug_on(
    monkeypatch: pytest.MonkeyPatch, make_agent_client: Any
) -> None:
    from paperclip.api import core_views

    def explode(*args: Any, **kwargs: Any) -> Any:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(core_views.MeApi, "get", explode)
    response = make_agent_client(AgentFactory()).get("/api/me")
    assert_error(response, 500, "internal_error")
    assert "ZeroDivisionError" not in response.content.decode()
    assert APIClient().get("/healthz").status_code == 200


def _terminate_django_backend() -> None:
    """End the session of Django's own connection from outside, as a failover would."""
    connection.ensure_connection()
    pid = connection.connection.info.backend_pid  # type: ignore[union-attr]
    with raw_connection() as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", [pid])
        while admin.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone():
            time.sleep(0.01)  # the backend exits asynchronously


@pytest.mark.parametrize("debug", [False, True])
def test_a_console_page_whose_database_is_lost_answers_503_then_works(
    superuser_client: Any, debug: bool
) -> None:
    """The console, not only the API: a page whose connection died answers 503 with
    Retry-After and a page that reloads itself (never Django's 500, with DEBUG on or off),
    and the next request opens a fresh connection."""
    with override_settings(DEBUG=debug):
        _terminate_django_backend()
        response = superuser_client.get("/admin/")
        assert response.status_code == 503
        assert response["Retry-After"] == "2"
        page = response.content.decode()
        assert "The database is unavailable" in page
        assert 'http-equiv="refresh"' in page
        assert superuser_client.get("/admin/").status_code == 200


@pytest.mark.parametrize("debug", [False, True])
def test_a_console_page_while_the_database_stays_down_answers_503(
    superuser_client: Any, debug: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No primary at all for the whole request (a failover in progress): every connection
    attempt is refused. The page still answers 503, not 500: nothing after the view (the
    request log's actor) goes back to the database for the session."""
    assert superuser_client.get("/admin/").status_code == 200
    connection.close()
    monkeypatch.setitem(connection.settings_dict, "HOST", "127.0.0.1")
    monkeypatch.setitem(connection.settings_dict, "PORT", str(free_port()))
    with override_settings(DEBUG=debug):
        response = superuser_client.get("/admin/")
    assert response.status_code == 503
    assert response["Retry-After"] == "2"
    monkeypatch.undo()
    connection.close()
    assert superuser_client.get("/admin/").status_code == 200
