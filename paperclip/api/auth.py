"""Authentication and authorization of the HTTP API.

Agents: `Authorization: Bearer pcak_<prefix>.<secret>`. Board (operators):
`Authorization: Bearer pcbt_<prefix>.<secret>` or a Django admin session. Secrets are stored as a
SHA-256 hash next to their public prefix and compared in constant time; a slow password hash
would sit on every request, and the secrets are 256-bit random, so it buys nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal
from uuid import UUID

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser
from django.db import models
from django.db.models import Q
from django.db.models.functions import Now
from rest_framework import authentication, exceptions, permissions
from rest_framework.request import Request

from paperclip.errors import NotFoundError
from paperclip.models import Agent, AgentApiKey, BoardApiToken, BoardMembership, Company

AGENT_KEY_KIND = "pcak"
BOARD_TOKEN_KIND = "pcbt"  # noqa: S105 - a key prefix, not a secret


_PREFIX_RE = re.compile(r"[0-9a-f]{1,32}")
_SECRET_RE = re.compile(r"[A-Za-z0-9_\-]{1,256}")
# last_used_at is bookkeeping, not a decision: refresh it at most this often, so a busy key does
# not turn every request into a write on one hot row.
LAST_USED_RESOLUTION = timedelta(seconds=60)


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def new_credential_parts() -> tuple[str, str]:
    """A fresh (prefix, secret) pair."""
    return secrets.token_hex(6), secrets.token_urlsafe(32)


def parse_bearer(header: str, kind: str) -> tuple[str, str] | None:
    """Split `Bearer <kind>_<prefix>.<secret>`; None when the header is for another kind."""
    parts = header.split()
    if len(parts) != 2 or parts[0].lower() != "bearer":
        return None
    token = parts[1]
    if not token.startswith(f"{kind}_"):
        return None
    prefix, sep, secret = token[len(kind) + 1 :].partition(".")
    # Checked before any query: a NUL or an oversized value must be a 401, not a database error.
    if not sep or not _PREFIX_RE.fullmatch(prefix) or not _SECRET_RE.fullmatch(secret):
        raise exceptions.AuthenticationFailed("Malformed API credential.")
    return prefix, secret


def _verify(
    model: type[AgentApiKey] | type[BoardApiToken], prefix: str, secret: str
) -> AgentApiKey | BoardApiToken:
    related = "agent" if model is AgentApiKey else "user"
    credential = model.objects.select_related(related).filter(prefix=prefix).first()
    if credential is None:
        # Compare anyway so an unknown prefix costs the same as a wrong secret.
        hmac.compare_digest(hash_secret(secret), "0" * 64)
        raise exceptions.AuthenticationFailed("Invalid API credential.")
    if not hmac.compare_digest(hash_secret(secret), credential.secret_sha256):
        raise exceptions.AuthenticationFailed("Invalid API credential.")
    if credential.revoked_at is not None:
        raise exceptions.AuthenticationFailed("This API credential has been revoked.")
    model.objects.filter(pk=credential.pk).filter(
        Q(last_used_at__isnull=True) | Q(last_used_at__lt=Now() - LAST_USED_RESOLUTION)
    ).update(last_used_at=Now())
    return credential


class _BearerAuthentication(authentication.BaseAuthentication):
    kind: str

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="api"'


class AgentKeyAuthentication(_BearerAuthentication):
    """`Bearer pcak_<prefix>.<secret>` → (Agent, AgentApiKey)."""

    kind = AGENT_KEY_KIND

    def authenticate(self, request: Request) -> tuple[Agent, AgentApiKey] | None:
        parsed = parse_bearer(
            authentication.get_authorization_header(request).decode("latin-1"), self.kind
        )
        if parsed is None:
            return None
        key = _verify(AgentApiKey, *parsed)
        if not isinstance(key, AgentApiKey):  # pragma: no cover - _verify returns its model
            raise exceptions.AuthenticationFailed()
        if key.agent.status == Agent.Status.TERMINATED:
            raise exceptions.AuthenticationFailed("This agent has been terminated.")
        return key.agent, key


class BoardTokenAuthentication(_BearerAuthentication):
    """`Bearer pcbt_<prefix>.<secret>` → (User, BoardApiToken); the user must be active staff."""

    kind = BOARD_TOKEN_KIND

    def authenticate(self, request: Request) -> tuple[Any, BoardApiToken] | None:
        parsed = parse_bearer(
            authentication.get_authorization_header(request).decode("latin-1"), self.kind
        )
        if parsed is None:
            return None
        token = _verify(BoardApiToken, *parsed)
        if not isinstance(token, BoardApiToken):  # pragma: no cover
            raise exceptions.AuthenticationFailed()
        if not token.user.is_active:
            raise exceptions.AuthenticationFailed("This user is inactive.")
        return token.user, token


@dataclass(frozen=True, slots=True)
class Actor:
    """Who is calling, in the terms services understand."""

    type: Literal["agent", "board"]
    agent: Agent | None = None
    user: AbstractBaseUser | None = None
    # None means every company (a superuser board member).
    company_ids: frozenset[UUID] | None = frozenset()

    @property
    def is_agent(self) -> bool:
        return self.type == "agent"

    @property
    def is_board(self) -> bool:
        return self.type == "board"

    @property
    def is_superuser(self) -> bool:
        return self.is_board and bool(getattr(self.user, "is_superuser", False))

    @property
    def actor_type(self) -> str:
        """The audit log's actor type: `agent` or `user`."""
        return "agent" if self.is_agent else "user"

    @property
    def actor_id(self) -> str:
        if self.agent is not None:
            return str(self.agent.pk)
        return str(self.user.pk) if self.user is not None else ""

    @property
    def agent_id(self) -> UUID | None:
        return self.agent.pk if self.agent is not None else None

    def can_access(self, company_id: UUID | str | None) -> bool:
        if company_id is None:
            return False
        if self.company_ids is None:
            return True
        try:
            return UUID(str(company_id)) in self.company_ids
        except ValueError:
            return False


def board_actor(user: Any) -> Actor:
    if user.is_superuser:
        return Actor(type="board", user=user, company_ids=None)
    ids = frozenset(BoardMembership.objects.filter(user=user).values_list("company_id", flat=True))
    return Actor(type="board", user=user, company_ids=ids)


def agent_actor(agent: Agent) -> Actor:
    return Actor(type="agent", agent=agent, company_ids=frozenset({agent.company_id}))


def actor_for(request: Request) -> Actor:
    """The Actor of an authenticated request (cached on the request)."""
    cached = getattr(request, "_paperclip_actor", None)
    if cached is not None:
        return cached
    user = request.user
    if isinstance(user, Agent):
        actor = agent_actor(user)
    elif user is None or isinstance(user, AnonymousUser) or not user.is_authenticated:
        raise exceptions.NotAuthenticated()
    elif user.is_staff and user.is_active:
        actor = board_actor(user)
    else:
        raise exceptions.PermissionDenied("Only board members (staff users) may use the API.")
    request._paperclip_actor = actor  # type: ignore[attr-defined]
    return actor


class IsAgent(permissions.BasePermission):
    message = "This endpoint is for agents."

    def has_permission(self, request: Request, view: Any) -> bool:
        return actor_for(request).is_agent


class IsBoard(permissions.BasePermission):
    message = "This endpoint is for board members."

    def has_permission(self, request: Request, view: Any) -> bool:
        return actor_for(request).is_board


class IsSuperuserBoard(permissions.BasePermission):
    message = "This endpoint is for superusers."

    def has_permission(self, request: Request, view: Any) -> bool:
        return actor_for(request).is_superuser


class IsAgentOrBoard(permissions.BasePermission):
    def has_permission(self, request: Request, view: Any) -> bool:
        actor_for(request)
        return True


def parse_uuid(value: Any) -> UUID | None:
    try:
        return UUID(str(value))
    except (ValueError, TypeError, AttributeError):
        return None


def scoped_get[M: models.Model](
    queryset: models.QuerySet[M], actor: Actor, pk: Any, *, company_field: str = "company_id"
) -> M:
    """The object `pk` if the actor may see its company; otherwise NotFoundError (404).

    Another company's object and a malformed id are both plain 404s: never reveal existence.
    """
    obj_id = parse_uuid(pk)
    if obj_id is None:
        raise NotFoundError()
    obj = queryset.filter(pk=obj_id).first()
    if obj is None or not actor.can_access(getattr(obj, company_field)):
        raise NotFoundError()
    return obj


def scoped_company(actor: Actor, company_id: Any) -> Company:
    return scoped_get(Company.objects.all(), actor, company_id, company_field="id")
