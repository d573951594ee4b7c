"""Issuing and revoking API credentials (agent keys, board tokens)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from uuid import UUID

from django.db import transaction
from django.db.models.functions import Now

from paperclip.activity import activity_record
from paperclip.api.auth import (
    AGENT_KEY_KIND,
    BOARD_TOKEN_KIND,
    hash_secret,
    new_credential_parts,
)
from paperclip.errors import NotFoundError
from paperclip.models import Agent, AgentApiKey, BoardApiToken


@dataclass(frozen=True, slots=True)
class IssuedCredential:
    id: UUID
    prefix: str
    secret: str  # the full bearer value, shown once

    def __str__(self) -> str:
        return self.secret


def agent_key_create(
    *, agent_id: UUID, actor_type: str = "system", actor_id: str = "cli", name: str = ""
) -> IssuedCredential:
    """Create an API key for the agent; the secret is only returned here."""
    prefix, secret = new_credential_parts()
    with transaction.atomic(durable=True):
        agent = Agent.objects.filter(pk=agent_id).first()
        if agent is None:
            raise NotFoundError()
        key = AgentApiKey.objects.create(
            agent=agent, prefix=prefix, secret_sha256=hash_secret(secret), name=name
        )
        activity_record(
            company_id=agent.company_id,
            actor_type=actor_type,
            actor_id=actor_id,
            action="agent_key.created",
            entity_type="agent_api_key",
            entity_id=key.pk,
            details={"agent_id": str(agent.pk), "prefix": prefix},
        )
    return IssuedCredential(id=key.pk, prefix=prefix, secret=f"{AGENT_KEY_KIND}_{prefix}.{secret}")


def agent_key_revoke(*, key_id: UUID, actor_type: str, actor_id: str) -> AgentApiKey:
    with transaction.atomic(durable=True):
        key = (
            AgentApiKey.objects.select_for_update()
            .select_related("agent")
            .filter(pk=key_id)
            .first()
        )
        if key is None:
            raise NotFoundError()
        if key.revoked_at is None:
            AgentApiKey.objects.filter(pk=key.pk).update(revoked_at=Now())
            activity_record(
                company_id=key.agent.company_id,
                actor_type=actor_type,
                actor_id=actor_id,
                action="agent_key.revoked",
                entity_type="agent_api_key",
                entity_id=key.pk,
                details={"agent_id": str(key.agent_id), "prefix": key.prefix},
            )
        key.refresh_from_db()
    return key


def board_token_create(*, user: Any, name: str = "") -> IssuedCredential:
    prefix, secret = new_credential_parts()
    with transaction.atomic(durable=True):
        token = BoardApiToken.objects.create(
            user=user, prefix=prefix, secret_sha256=hash_secret(secret), name=name
        )
        activity_record(
            company_id=None,
            actor_type="system",
            actor_id="cli",
            action="board_token.created",
            entity_type="board_api_token",
            entity_id=token.pk,
            details={"user_id": str(user.pk), "prefix": prefix},
        )
    return IssuedCredential(
        id=token.pk, prefix=prefix, secret=f"{BOARD_TOKEN_KIND}_{prefix}.{secret}"
    )
