"""An agent's lookups: `GET /api/me/issues` (assigned to it, not hidden) and
`GET /api/me/execution-workspaces` (its company's), newest first, 100 a page with a `next`
link; agents only; other agents' and companies' rows never appear (docs/api.md#agents-lookups)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from django.core import signals
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from django.utils import timezone

from paperclip.credentials import agent_key_create
from paperclip.models import ActivityEvent, ExecutionWorkspace, Issue
from paperclip_client import Client
from tests.paperclip.factories import (
    AgentFactory,
    CompanyFactory,
    ExecutionWorkspaceFactory,
    IssueFactory,
)

pytestmark = pytest.mark.django_db


def test_an_agent_lists_its_own_issues_newest_first_in_pages(make_agent_client: Any) -> None:
    company = CompanyFactory()
    agent, other = AgentFactory(company=company), AgentFactory(company=company)
    mine = [IssueFactory(company=company, assignee_agent=agent) for _ in range(103)]
    IssueFactory(company=company, assignee_agent=agent, hidden_at=timezone.now())
    IssueFactory(company=company, assignee_agent=other)
    IssueFactory(assignee_agent=AgentFactory())  # another company's
    client = make_agent_client(agent)
    writes = ActivityEvent.objects.count()
    first = client.get("/api/me/issues")
    assert first.status_code == 200
    page = first.json()
    assert len(page["results"]) == 100
    assert page["next"] is not None
    second = client.get(page["next"]).json()
    assert second["next"] is None
    listed = [row["id"] for row in page["results"] + second["results"]]
    newest_first = Issue.objects.filter(pk__in=[i.pk for i in mine]).order_by("-created_at", "-id")
    assert listed == [str(pk) for pk in newest_first.values_list("pk", flat=True)]
    assert ActivityEvent.objects.count() == writes  # reads write nothing


def test_an_agent_lists_its_companys_workspaces(make_agent_client: Any) -> None:
    company = CompanyFactory()
    agent = AgentFactory(company=company)
    ours = [ExecutionWorkspaceFactory(company=company) for _ in range(3)]
    ExecutionWorkspaceFactory()  # another company's
    body = make_agent_client(agent).get("/api/me/execution-workspaces").json()
    assert body["next"] is None
    expected = ExecutionWorkspace.objects.filter(pk__in=[w.pk for w in ours]).order_by(
        "-created_at", "-id"
    )
    assert [row["id"] for row in body["results"]] == [str(w.pk) for w in expected]
    assert set(body["results"][0]) >= {"id", "company_id", "name", "cwd", "status"}


def test_lookups_are_for_agents(make_board_client: Any) -> None:
    board = make_board_client(CompanyFactory())
    for path in ("/api/me/issues", "/api/me/execution-workspaces"):
        response = board.get(path)
        assert response.status_code == 403
        assert response.json()["error"]["code"] == "permission_denied"


def test_a_forged_cursor_is_a_clean_error(make_agent_client: Any) -> None:
    response = make_agent_client(AgentFactory()).get("/api/me/issues?cursor=*not*base64*")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"


def test_the_client_follows_every_page() -> None:
    company = CompanyFactory()
    agent = AgentFactory(company=company)
    for _ in range(101):
        IssueFactory(company=company, assignee_agent=agent)
    ExecutionWorkspaceFactory(company=company)
    transport = httpx.WSGITransport(app=get_wsgi_application())
    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    try:
        key = agent_key_create(agent_id=agent.pk).secret
        with Client("http://testserver", key, transport=transport, retries=0) as client:
            assert len(client.my_issues()) == 101
            assert len(client.my_execution_workspaces()) == 1
    finally:
        signals.request_started.connect(close_old_connections)
        signals.request_finished.connect(close_old_connections)
