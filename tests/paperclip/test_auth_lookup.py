"""The bearer-credential lookup: one statement per request loads the key with its principal;
`last_used_at` is refreshed only for a valid, unrevoked key, at most once a minute."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from rest_framework.exceptions import AuthenticationFailed
from rest_framework.test import APIRequestFactory

from paperclip.api.auth import AgentKeyAuthentication, BoardTokenAuthentication
from paperclip.credentials import agent_key_create, agent_key_revoke, board_token_create
from paperclip.models import Agent, AgentApiKey, BoardApiToken
from tests.helpers import assert_error
from tests.paperclip.factories import UserFactory
from tests.paperclip.helpers import bearer_client

pytestmark = pytest.mark.django_db


def _request(secret: str):
    return APIRequestFactory().get("/api/me", HTTP_AUTHORIZATION=f"Bearer {secret}")


def _values(instance) -> dict:
    return {f.attname: getattr(instance, f.attname) for f in type(instance)._meta.concrete_fields}


def test_agent_key_loads_key_and_agent_as_the_orm_would(agent: Agent) -> None:
    issued = agent_key_create(agent_id=agent.pk)
    agent_obj, key = AgentKeyAuthentication().authenticate(_request(issued.secret))
    assert isinstance(agent_obj, Agent)
    assert isinstance(key, AgentApiKey)
    assert _values(key) == _values(AgentApiKey.objects.get(pk=issued.id))
    assert _values(agent_obj) == _values(Agent.objects.get(pk=agent.pk))
    assert not key._state.adding
    assert key._state.db == "default"
    # The principal is cached on the key, like select_related: no further query.
    with CaptureQueriesContext(connection) as queries:
        assert key.agent is agent_obj
    assert len(queries) == 0


def test_board_token_loads_token_and_user_as_the_orm_would() -> None:
    user = UserFactory()
    issued = board_token_create(user=user)
    user_obj, token = BoardTokenAuthentication().authenticate(_request(issued.secret))
    assert isinstance(token, BoardApiToken)
    assert _values(token) == _values(BoardApiToken.objects.get(pk=issued.id))
    assert _values(user_obj) == _values(type(user).objects.get(pk=user.pk))
    assert token.user is user_obj


def test_authentication_is_one_statement_plus_the_refresh_when_due(agent: Agent) -> None:
    issued = agent_key_create(agent_id=agent.pk)
    client = bearer_client(issued.secret)
    for expected in (2, 1, 1):  # the first use writes last_used_at; the next ones only read
        with CaptureQueriesContext(connection) as queries:
            assert client.get("/api/me").status_code == 200
        assert len(queries) == expected, [q["sql"] for q in queries]
    stale = AgentApiKey.objects.get(pk=issued.id).last_used_at - timedelta(minutes=2)
    AgentApiKey.objects.filter(pk=issued.id).update(last_used_at=stale)
    with CaptureQueriesContext(connection) as queries:
        assert client.get("/api/me").status_code == 200
    assert len(queries) == 2
    assert AgentApiKey.objects.get(pk=issued.id).last_used_at > stale


def test_wrong_secret_does_not_touch_last_used_at(agent: Agent) -> None:
    issued = agent_key_create(agent_id=agent.pk)
    prefix = issued.secret.removeprefix("pcak_").split(".", 1)[0]
    assert_error(bearer_client(f"pcak_{prefix}.wrong").get("/api/me"), 401, "not_authenticated")
    assert AgentApiKey.objects.get(pk=issued.id).last_used_at is None


def test_revoked_key_is_refused_on_the_next_request_and_not_bumped(agent: Agent) -> None:
    issued = agent_key_create(agent_id=agent.pk)
    client = bearer_client(issued.secret)
    assert client.get("/api/me").status_code == 200
    agent_key_revoke(key_id=issued.id, actor_type="system", actor_id="test")
    stale = AgentApiKey.objects.get(pk=issued.id).last_used_at - timedelta(minutes=5)
    AgentApiKey.objects.filter(pk=issued.id).update(last_used_at=stale)
    assert_error(client.get("/api/me"), 401, "not_authenticated")
    assert AgentApiKey.objects.get(pk=issued.id).last_used_at == stale


def test_last_used_at_is_refreshed_only_after_the_resolution(agent: Agent) -> None:
    issued = agent_key_create(agent_id=agent.pk)
    client = bearer_client(issued.secret)
    client.get("/api/me")
    first = AgentApiKey.objects.get(pk=issued.id).last_used_at
    recent = first - timedelta(seconds=50)
    AgentApiKey.objects.filter(pk=issued.id).update(last_used_at=recent)
    client.get("/api/me")
    assert AgentApiKey.objects.get(pk=issued.id).last_used_at == recent
    old = first - timedelta(seconds=70)
    AgentApiKey.objects.filter(pk=issued.id).update(last_used_at=old)
    _, key = AgentKeyAuthentication().authenticate(_request(issued.secret))
    stored = AgentApiKey.objects.get(pk=issued.id).last_used_at
    assert stored > old
    assert key.last_used_at == stored  # the instance carries the value just written


def test_a_key_of_another_kind_with_the_same_prefix_is_not_found(agent: Agent) -> None:
    issued = agent_key_create(agent_id=agent.pk)
    with pytest.raises(AuthenticationFailed):
        BoardTokenAuthentication().authenticate(
            _request("pcbt_" + issued.secret.removeprefix("pcak_"))
        )
    assert AgentApiKey.objects.get(pk=issued.id).last_used_at is None


def _prepared_statements() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        return [row[0] for row in cursor.fetchall()]


def test_the_lookup_is_prepared_once_per_session_and_reused(agent: Agent) -> None:
    issued = agent_key_create(agent_id=agent.pk)
    client = bearer_client(issued.secret)
    for _ in range(3):
        assert client.get("/api/me").status_code == 200
    lookups = [s for s in _prepared_statements() if '"agent_api_keys"' in s]
    assert len(lookups) == 1
    assert 'WHERE c."prefix" = $1' in lookups[0]
    # Django's own (client-side binding) statements are never prepared.
    assert not any("activity" in s or "INSERT" in s for s in _prepared_statements())


def test_the_lookup_survives_a_rolled_back_savepoint(agent: Agent) -> None:
    """psycopg forgets its prepared statements after a rollback; the next lookup re-prepares."""
    issued = agent_key_create(agent_id=agent.pk)
    client = bearer_client(issued.secret)
    assert client.get("/api/me").status_code == 200
    sid = transaction.savepoint_create()
    Agent.objects.filter(pk=agent.pk).update(name="renamed")
    transaction.savepoint_rollback(sid)
    assert client.get("/api/me").status_code == 200
    with connection.cursor() as cursor:
        cursor.execute("DEALLOCATE ALL")
    assert client.get("/api/me").status_code == 200
