"""An agent's renew over HTTP costs two round trips to PostgreSQL on a reused connection: the
credential lookup (which stands in for the connection health check) and the renew itself.
A connection whose session ended since its last use is replaced within the same request.

Round trips are read from libpq's own protocol trace of the connection: every `Query`
(simple protocol) or `Sync` (end of an extended-protocol exchange) the client sends is one.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import close_old_connections, connection
from rest_framework.test import APIClient

from leases.models import WorkspaceRuntimeLease
from paperclip.models import ActivityEvent, Agent
from tests.helpers import raw_connection
from tests.leases.factories import claim
from tests.paperclip.factories import AgentFactory, ExecutionWorkspaceFactory

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def persistent_connections() -> Iterator[None]:
    """Connections kept across requests, as in production (DJANGO_CONN_MAX_AGE); the test
    settings close them after each request."""
    connection.close()
    before = connection.settings_dict["CONN_MAX_AGE"]
    connection.settings_dict["CONN_MAX_AGE"] = 600
    try:
        yield
    finally:
        connection.settings_dict["CONN_MAX_AGE"] = before
        connection.close()


def _traced(call: Callable[[], Any]) -> tuple[Any, list[str]]:
    """`call()`'s result and the protocol messages this connection sent meanwhile."""
    with tempfile.TemporaryFile("w+") as trace:
        pgconn = connection.connection.pgconn
        pgconn.trace(trace.fileno())
        try:
            result = call()
        finally:
            pgconn.untrace()
        trace.seek(0)
        sent = [line.split("\t")[3].strip() for line in trace if "\tF\t" in line]
    return result, sent


def _renewing(agent: Agent, make_agent_client: Callable[[Agent], APIClient]) -> Callable[[], Any]:
    workspace = ExecutionWorkspaceFactory(company=agent.company)
    claim(workspace, agent)
    client = make_agent_client(agent)
    url = f"/api/execution-workspaces/{workspace.pk}/runtime-lease/claim"

    def renew() -> Any:
        # What a server's request_started does, and Django's test client leaves out: the
        # connection's health check becomes due again (CONN_HEALTH_CHECKS).
        close_old_connections()
        return client.post(url, {"action": "start"}, format="json")

    return renew


def test_a_renew_on_a_reused_connection_is_two_round_trips(
    persistent_connections: None, make_agent_client: Callable[[Agent], APIClient]
) -> None:
    renew = _renewing(AgentFactory(), make_agent_client)
    assert renew().json()["outcome"] == "renewed"  # connects, prepares, records the key's use
    for _ in range(3):
        response, sent = _traced(renew)
        assert response.status_code == 200
        assert response.json()["outcome"] == "renewed"
        round_trips = [message for message in sent if message in ("Query", "Sync")]
        # The credential lookup and the renew, both prepared (Bind/Execute/Sync): no
        # `SELECT 1` health check, no BEGIN/COMMIT.
        assert round_trips == ["Sync", "Sync"], sent


def test_a_connection_whose_session_ended_is_replaced_and_the_request_served(
    persistent_connections: None, make_agent_client: Callable[[Agent], APIClient]
) -> None:
    renew = _renewing(AgentFactory(), make_agent_client)
    assert renew().status_code == 200
    audit_rows = ActivityEvent.objects.count()
    # The test client serves requests on this thread's connection, the one the test uses too.
    ended = connection.connection.info.backend_pid
    with raw_connection() as admin:
        admin.execute("SELECT pg_terminate_backend(%s, 5000)", [ended])
    # The connection object still looks open: only the next statement finds out.
    assert not connection.connection.closed
    response = renew()
    assert response.status_code == 200, response.content
    assert response.json()["outcome"] == "renewed"
    assert connection.connection.info.backend_pid != ended
    assert ActivityEvent.objects.count() == audit_rows  # a renew writes no audit row
    assert WorkspaceRuntimeLease.objects.count() == 1
