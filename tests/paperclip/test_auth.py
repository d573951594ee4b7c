"""Authentication: agent keys, board tokens, sessions, and how each failure answers."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from paperclip.credentials import agent_key_create, agent_key_revoke, board_token_create
from paperclip.models import Agent, AgentApiKey, BoardApiToken
from tests.helpers import assert_error
from tests.paperclip.factories import AgentFactory, UserFactory
from tests.paperclip.helpers import bearer_client

pytestmark = pytest.mark.django_db


def test_valid_agent_key_authenticates_as_the_agent(agent: Agent) -> None:
    issued = agent_key_create(agent_id=agent.pk)
    response = bearer_client(issued.secret).get("/api/me")
    assert response.status_code == 200
    assert response.json() == {
        "actor_type": "agent",
        "agent_id": str(agent.pk),
        "company_ids": [str(agent.company_id)],
    }


def test_agent_key_is_stored_as_prefix_and_hash_only(agent: Agent) -> None:
    issued = agent_key_create(agent_id=agent.pk)
    key = AgentApiKey.objects.get(pk=issued.id)
    assert issued.secret.startswith(f"pcak_{key.prefix}.")
    secret_part = issued.secret.split(".", 1)[1]
    assert secret_part not in key.secret_sha256
    assert len(key.secret_sha256) == 64


def test_valid_board_token_authenticates_a_member(company) -> None:
    user = UserFactory()
    user.board_memberships.create(company=company)
    response = bearer_client(board_token_create(user=user).secret).get("/api/me")
    assert response.status_code == 200
    body = response.json()
    assert body["actor_type"] == "board"
    assert body["user"] == {"id": user.pk, "username": user.username, "is_superuser": False}
    assert body["company_ids"] == [str(company.pk)]


def test_superuser_board_sees_every_company(company, other_company) -> None:
    user = UserFactory(is_superuser=True)
    response = bearer_client(board_token_create(user=user).secret).get("/api/me")
    assert set(response.json()["company_ids"]) == {str(company.pk), str(other_company.pk)}


def test_staff_session_user_is_a_board_actor(company) -> None:
    user = UserFactory()
    user.board_memberships.create(company=company)
    client = APIClient()
    client.force_login(user)
    response = client.get("/api/me")
    assert response.status_code == 200
    assert response.json()["actor_type"] == "board"


def test_non_staff_user_is_forbidden(company) -> None:
    user = UserFactory(is_staff=False)
    client = APIClient()
    client.force_login(user)
    assert_error(client.get("/api/me"), 403, "permission_denied")
    token_client = bearer_client(board_token_create(user=user).secret)
    assert_error(token_client.get("/api/me"), 403, "permission_denied")


def test_inactive_board_user_is_rejected() -> None:
    user = UserFactory(is_active=False)
    assert_error(
        bearer_client(board_token_create(user=user).secret).get("/api/me"), 401, "not_authenticated"
    )


def test_no_credentials_is_401_with_challenge() -> None:
    response = APIClient().get("/api/me")
    assert_error(response, 401, "not_authenticated")
    assert response["WWW-Authenticate"].startswith("Bearer")


def test_revoked_agent_key_is_rejected(agent: Agent) -> None:
    issued = agent_key_create(agent_id=agent.pk)
    client = bearer_client(issued.secret)
    assert client.get("/api/me").status_code == 200
    agent_key_revoke(key_id=issued.id, actor_type="system", actor_id="test")
    assert_error(client.get("/api/me"), 401, "not_authenticated")


def test_terminated_agent_is_rejected(agent: Agent) -> None:
    issued = agent_key_create(agent_id=agent.pk)
    Agent.objects.filter(pk=agent.pk).update(status=Agent.Status.TERMINATED)
    assert_error(bearer_client(issued.secret).get("/api/me"), 401, "not_authenticated")


@pytest.mark.parametrize(
    "header",
    [
        "Bearer pcak_",
        "Bearer pcak_abc",
        "Bearer pcak_.secret",
        "Bearer pcak_abc.",
        "Bearer pcak_ABC!.secret",
        "Bearer pcak_abc\x00def.secret",
        "Bearer pcak_abc.sec\x00ret",
        "Bearer pcak_" + "a" * 40 + ".secret",
        "Bearer pcak_abc." + "s" * 300,
        "Bearer pcbt_zz.secret",
        "Bearer pcxx_abc.secret",
        "Bearer",
        "Basic dXNlcjpwdw==",
        "Bearer pcak_abc.secret extra",
    ],
)
def test_malformed_or_foreign_credentials_are_401(header: str) -> None:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=header)
    assert_error(client.get("/api/me"), 401, "not_authenticated")


def test_unknown_prefix_and_wrong_secret_are_401(agent: Agent) -> None:
    issued = agent_key_create(agent_id=agent.pk)
    prefix, secret = issued.secret.removeprefix("pcak_").split(".", 1)
    assert_error(
        bearer_client(f"pcak_{'0' * 12}.{secret}").get("/api/me"), 401, "not_authenticated"
    )
    assert_error(bearer_client(f"pcak_{prefix}.{secret}x").get("/api/me"), 401, "not_authenticated")


def test_agent_key_presented_as_board_token_is_rejected(agent: Agent) -> None:
    issued = agent_key_create(agent_id=agent.pk)
    as_board = "pcbt_" + issued.secret.removeprefix("pcak_")
    assert_error(bearer_client(as_board).get("/api/me"), 401, "not_authenticated")


def test_last_used_at_is_recorded(agent: Agent) -> None:
    issued = agent_key_create(agent_id=agent.pk)
    assert AgentApiKey.objects.get(pk=issued.id).last_used_at is None
    bearer_client(issued.secret).get("/api/me")
    first = AgentApiKey.objects.get(pk=issued.id).last_used_at
    assert first is not None
    # Within the resolution window it is not rewritten; after it, it is.
    bearer_client(issued.secret).get("/api/me")
    assert AgentApiKey.objects.get(pk=issued.id).last_used_at == first
    AgentApiKey.objects.filter(pk=issued.id).update(last_used_at=first - timedelta(minutes=5))
    bearer_client(issued.secret).get("/api/me")
    assert AgentApiKey.objects.get(pk=issued.id).last_used_at > first - timedelta(minutes=5)


def test_board_token_last_used_at_is_recorded() -> None:
    user = UserFactory()
    issued = board_token_create(user=user)
    bearer_client(issued.secret).get("/api/me")
    used = BoardApiToken.objects.get(pk=issued.id).last_used_at
    assert used is not None
    assert used <= timezone.now() + timedelta(seconds=5)


def test_agent_calling_a_board_endpoint_is_403(agent_client: APIClient, company) -> None:
    response = agent_client.post(
        f"/api/companies/{company.pk}/agents", {"name": "x"}, format="json"
    )
    assert_error(response, 403, "permission_denied")


def test_agent_key_of_one_agent_does_not_act_for_another(company) -> None:
    a, b = AgentFactory(company=company), AgentFactory(company=company)
    body = bearer_client(agent_key_create(agent_id=a.pk).secret).get("/api/me").json()
    assert body["agent_id"] == str(a.pk) != str(b.pk)
