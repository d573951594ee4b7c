"""Issuing and revoking API credentials (agent keys, board tokens)."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from django.contrib.auth import get_user_model
from django.db import transaction
from django.db.models.functions import Now

from paperclip.activity import activity_record, row_update_audited
from paperclip.errors import BoardUserInactive, NotFoundError
from paperclip.locks import agent_keys_for_update, board_tokens_for_update, users_for_update
from paperclip.models import Agent, AgentApiKey, BoardApiToken

AGENT_KEY_KIND = "pcak"
BOARD_TOKEN_KIND = "pcbt"  # noqa: S105 - a key prefix, not a secret


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def new_credential_parts() -> tuple[str, str]:
    """A fresh (prefix, secret) pair."""
    return secrets.token_hex(6), secrets.token_urlsafe(32)


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
    """Create an API key for the agent; the secret is only returned here.

    Raises NotFoundError for an unknown agent. Callers check the actor's access first.
    """
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


@dataclass(frozen=True, slots=True)
class CredentialRevocation:
    id: UUID
    prefix: str
    revoked_at: datetime
    changed: bool  # False when it was already revoked (nothing written)


def _revoked_at(value: datetime | None) -> datetime:
    if value is None:  # pragma: no cover - set in the same transaction just above
        raise RuntimeError("revoked_at was not set")
    return value


def agent_key_revoke(*, key_id: UUID, actor_type: str, actor_id: str) -> CredentialRevocation:
    """Revoke an agent key (idempotent: a revoked key stays revoked, with no second audit row).

    Locks the key row. Raises NotFoundError for an unknown key.
    """
    with transaction.atomic(durable=True):
        key = agent_keys_for_update().select_related("agent").filter(pk=key_id).first()
        if key is None:
            raise NotFoundError()
        changed = key.revoked_at is None
        if changed:
            row_update_audited(
                key,
                {"revoked_at": Now()},
                company_id=key.agent.company_id,
                actor_type=actor_type,
                actor_id=actor_id,
                action="agent_key.revoked",
                entity_type="agent_api_key",
                entity_id=key.pk,
                details={"agent_id": str(key.agent_id), "prefix": key.prefix},
            )
    return CredentialRevocation(
        id=key.pk, prefix=key.prefix, revoked_at=_revoked_at(key.revoked_at), changed=changed
    )


def board_token_revoke(*, token_id: UUID, actor_type: str, actor_id: str) -> CredentialRevocation:
    """Revoke a board token (idempotent). Locks the token row; NotFoundError if unknown."""
    with transaction.atomic(durable=True):
        token = board_tokens_for_update().filter(pk=token_id).first()
        if token is None:
            raise NotFoundError()
        changed = token.revoked_at is None
        if changed:
            row_update_audited(
                token,
                {"revoked_at": Now()},
                company_id=None,
                actor_type=actor_type,
                actor_id=actor_id,
                action="board_token.revoked",
                entity_type="board_api_token",
                entity_id=token.pk,
                details={"user_id": str(token.user_id), "prefix": token.prefix},
            )
    return CredentialRevocation(
        id=token.pk, prefix=token.prefix, revoked_at=_revoked_at(token.revoked_at), changed=changed
    )


def board_token_create(
    *, user: Any, actor_type: str = "system", actor_id: str = "cli", name: str = ""
) -> IssuedCredential:
    """Create an API token for a board (staff) user; the secret is only returned here."""
    prefix, secret = new_credential_parts()
    with transaction.atomic(durable=True):
        token = BoardApiToken.objects.create(
            user=user, prefix=prefix, secret_sha256=hash_secret(secret), name=name
        )
        activity_record(
            company_id=None,
            actor_type=actor_type,
            actor_id=actor_id,
            action="board_token.created",
            entity_type="board_api_token",
            entity_id=token.pk,
            details={"user_id": str(user.pk), "prefix": prefix},
        )
    return IssuedCredential(
        id=token.pk, prefix=prefix, secret=f"{BOARD_TOKEN_KIND}_{prefix}.{secret}"
    )


@dataclass(frozen=True, slots=True)
class BoardUser:
    user: Any
    created: bool
    changes: dict[str, bool]  # the flags that were switched on ({} when nothing changed)


def board_user_ensure(*, username: str, superuser: bool) -> BoardUser:
    """The staff user `username`, created (no usable password: API only) or made staff (and
    superuser if asked) as needed. Locks the user row; audits a creation or a change;
    BoardUserInactive for an inactive user (nothing changed)."""
    user_model = get_user_model()
    with transaction.atomic(durable=True):
        user = users_for_update().filter(**{user_model.USERNAME_FIELD: username}).first()
        created = user is None
        if user is None:
            user = user_model(**{user_model.USERNAME_FIELD: username})
            user.set_unusable_password()
        if not user.is_active:
            raise BoardUserInactive(username=username)
        changes: dict[str, bool] = {}
        if not user.is_staff:
            changes["is_staff"] = True
        if superuser and not user.is_superuser:
            changes["is_superuser"] = True
        for field, value in changes.items():
            setattr(user, field, value)
        if created or changes:
            user.save()
            activity_record(
                company_id=None,
                actor_type="system",
                actor_id="cli",
                action="board_user.created" if created else "board_user.updated",
                entity_type="user",
                entity_id=str(user.pk),
                details={"username": username, **changes},
            )
    return BoardUser(user=user, created=created, changes=changes)
