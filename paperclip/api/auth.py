"""Authentication and authorization of the HTTP API.

Agents: `Authorization: Bearer pcak_<prefix>.<secret>`. Board (operators):
`Authorization: Bearer pcbt_<prefix>.<secret>` or a Django admin session. Secrets are stored as a
SHA-256 hash next to their public prefix and compared in constant time; a slow password hash
would sit on every request, and the secrets are 256-bit random, so it buys nothing.
"""

from __future__ import annotations

import functools
import hmac
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.contrib.auth.models import AnonymousUser
from django.core.exceptions import ImproperlyConfigured
from django.db import connection, models
from django.db.models import Field
from rest_framework import authentication, exceptions, permissions
from rest_framework.request import Request

from paperclip.access import Actor, agent_actor, board_actor
from paperclip.credentials import AGENT_KEY_KIND, BOARD_TOKEN_KIND, hash_secret
from paperclip.db.prepared import first_read
from paperclip.db.sql import quoted_column, quoted_table
from paperclip.models import Agent, AgentApiKey, BoardApiToken

_PREFIX_RE = re.compile(r"[0-9a-f]{1,32}")
_SECRET_RE = re.compile(r"[A-Za-z0-9_\-]{1,256}")
# last_used_at is bookkeeping, not a decision: refresh it at most this often, so a busy key does
# not turn every request into a write on one hot row.
LAST_USED_RESOLUTION = timedelta(seconds=60)
_RESOLUTION_SECONDS = int(LAST_USED_RESOLUTION.total_seconds())


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


type _Converter = Callable[[Any, Any, Any], Any]


def _converters(fields: Sequence[Field[Any, Any]]) -> tuple[tuple[int, list[_Converter]], ...]:
    """The value converters the ORM's compiler would apply, per column that has any."""
    result = []
    for index, field in enumerate(fields):
        col = field.get_col(field.model._meta.db_table)
        found = connection.ops.get_db_converters(col) + field.get_db_converters(connection)
        if found:
            result.append((index, found))
    return tuple(result)


@dataclass(frozen=True, slots=True)
class _CredentialQuery:
    """The credential lookup as two prebuilt statements: one SELECT of the credential joined
    with its principal (every request), and the `last_used_at` refresh (at most once per
    LAST_USED_RESOLUTION per credential, after the secret has been verified).

    Built once per model from `_meta` (so it follows the schema) and run as raw SQL: the ORM
    compiled the same lookup on every request, which was most of authentication's cost (see
    bench/leases.py). Rows become instances through `from_db` and the field converters, as
    the ORM would build them. Whether the refresh is due is decided by the database clock in
    the SELECT, and re-checked by the UPDATE itself, so concurrent requests write it once.
    The SELECT is a prepared statement, and the request's first: it stands in for the
    connection health check (`paperclip.db.prepared.first_read`); parsing and planning it on
    every request cost more than executing it. (A single statement with the UPDATE in a CTE was
    measured too: planning it costs more than the rare second round trip.)
    """

    model: type[AgentApiKey] | type[BoardApiToken]
    principal: type[models.Model]
    relation: models.ForeignKey[Any, Any]
    select_sql: str
    touch_sql: str
    credential_fields: tuple[str, ...]
    principal_fields: tuple[str, ...]
    converters: tuple[tuple[int, list[_Converter]], ...]

    @classmethod
    def build(cls, model: type[AgentApiKey] | type[BoardApiToken]) -> _CredentialQuery:
        relation = model._meta.get_field("agent" if model is AgentApiKey else "user")
        principal = relation.related_model
        if not isinstance(relation, models.ForeignKey) or not isinstance(principal, type):
            raise ImproperlyConfigured(f"{model} has no principal foreign key")  # pragma: no cover
        meta = model._meta
        fields = list(meta.concrete_fields)
        principal_fields = list(principal._meta.concrete_fields)
        key_pk, last_used = quoted_column(meta.pk), quoted_column(meta.get_field("last_used_at"))
        table = quoted_table(model)

        def due(column: str) -> str:
            """SQL: the stored last use is missing or older than the resolution (DB clock)."""
            return (
                f"({column} IS NULL"
                f" OR {column} < now() - make_interval(secs => {_RESOLUTION_SECONDS}))"
            )

        columns = [f"c.{quoted_column(field)}" for field in fields]
        columns += [f"p.{quoted_column(field)}" for field in principal_fields]
        select_sql = (
            f"SELECT {', '.join(columns)}, {due(f'c.{last_used}')}"  # noqa: S608 - identifiers from _meta
            f" FROM {table} c JOIN {quoted_table(principal)} p"
            f" ON p.{quoted_column(principal._meta.pk)} = c.{quoted_column(relation)}"
            f" WHERE c.{quoted_column(meta.get_field('prefix'))} = %s"
        )
        touch_sql = (
            f"UPDATE {table} SET {last_used} = now()"  # noqa: S608 - identifiers from _meta
            f" WHERE {key_pk} = %s AND {quoted_column(meta.get_field('revoked_at'))} IS NULL"
            f" AND {due(last_used)} RETURNING {last_used}"
        )
        return cls(
            model=model,
            principal=principal,
            relation=relation,
            select_sql=select_sql,
            touch_sql=touch_sql,
            credential_fields=tuple(field.attname for field in fields),
            principal_fields=tuple(field.attname for field in principal_fields),
            converters=_converters(fields + principal_fields),
        )

    def fetch(self, prefix: str) -> tuple[AgentApiKey | BoardApiToken, bool] | None:
        """(credential with its principal cached, whether last_used_at is due); None when
        no credential has this prefix."""
        row = first_read(self.select_sql, [prefix])
        if row is None:
            return None
        values = list(row[:-1])
        for index, converters in self.converters:
            for convert in converters:
                values[index] = convert(values[index], None, connection)
        split = len(self.credential_fields)
        credential = self.model.from_db(connection.alias, self.credential_fields, values[:split])
        principal = self.principal.from_db(connection.alias, self.principal_fields, values[split:])
        self.relation.set_cached_value(credential, principal)
        return credential, bool(row[-1])

    def touch(self, credential: AgentApiKey | BoardApiToken) -> None:
        """Record the use (no-op when a concurrent request just did)."""
        with connection.cursor() as cursor:
            cursor.execute(self.touch_sql, [credential.pk])
            row = cursor.fetchone()
        if row is not None:
            credential.last_used_at = row[0]


@functools.cache
def _credential_query(model: type[AgentApiKey] | type[BoardApiToken]) -> _CredentialQuery:
    return _CredentialQuery.build(model)


def _verify(
    model: type[AgentApiKey] | type[BoardApiToken], prefix: str, secret: str
) -> AgentApiKey | BoardApiToken:
    """The credential with `prefix` whose hash matches `secret`, with its principal loaded;
    AuthenticationFailed otherwise. Revocation is read from the row on every request, so it
    takes effect on the next one. One statement, plus the `last_used_at` refresh when due."""
    query = _credential_query(model)
    presented = hash_secret(secret)
    found = query.fetch(prefix)
    if found is None:
        # Compare anyway so an unknown prefix costs the same as a wrong secret.
        hmac.compare_digest(presented, "0" * 64)
        raise exceptions.AuthenticationFailed("Invalid API credential.")
    credential, last_used_due = found
    if not hmac.compare_digest(presented, credential.secret_sha256):
        raise exceptions.AuthenticationFailed("Invalid API credential.")
    if credential.revoked_at is not None:
        raise exceptions.AuthenticationFailed("This API credential has been revoked.")
    if last_used_due:
        query.touch(credential)
    return credential


def _authorization(request: Request) -> str:
    """The Authorization header as the WSGI server passed it (latin-1 text), what DRF's
    `get_authorization_header` reads through `request.headers`, which builds a dictionary of
    every header on first use."""
    value = request.META.get("HTTP_AUTHORIZATION", "")
    return value if isinstance(value, str) else value.decode("latin-1")


class _BearerAuthentication(authentication.BaseAuthentication):
    kind: str

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="api"'


class AgentKeyAuthentication(_BearerAuthentication):
    """`Bearer pcak_<prefix>.<secret>` → (Agent, AgentApiKey)."""

    kind = AGENT_KEY_KIND

    def authenticate(self, request: Request) -> tuple[Agent, AgentApiKey] | None:
        return authenticate_agent_key(_authorization(request))


def authenticate_agent_key(header: str) -> tuple[Agent, AgentApiKey] | None:
    """An `Authorization` header's agent key → (Agent, AgentApiKey); None when the header
    carries no agent key; AuthenticationFailed when it carries a malformed, unknown, wrong,
    revoked or terminated agent's one. What `AgentKeyAuthentication` does, callable without
    DRF's request (the lean claim view, leases/api/lean.py). Nothing is cached: revocation
    is read from the row on every request."""
    parsed = parse_bearer(header, AGENT_KEY_KIND)
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
        parsed = parse_bearer(_authorization(request), self.kind)
        if parsed is None:
            return None
        token = _verify(BoardApiToken, *parsed)
        if not isinstance(token, BoardApiToken):  # pragma: no cover
            raise exceptions.AuthenticationFailed()
        if not token.user.is_active:
            raise exceptions.AuthenticationFailed("This user is inactive.")
        return token.user, token


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


def _is_provider(actor: Actor) -> bool:
    return actor.agent is not None and actor.agent.role == Agent.Role.PROVIDER


class IsProviderAgent(permissions.BasePermission):
    """Environment leases and their cleanups: provider agents only (docs/api.md#agent-roles);
    a worker agent or a board member gets 403 before any lookup."""

    message = "This endpoint is for provider agents (role provider)."

    def has_permission(self, request: Request, view: Any) -> bool:
        return _is_provider(actor_for(request))


class IsProviderAgentOrBoard(permissions.BasePermission):
    message = "This endpoint is for provider agents (role provider) and board members."

    def has_permission(self, request: Request, view: Any) -> bool:
        actor = actor_for(request)
        return actor.is_board or _is_provider(actor)
