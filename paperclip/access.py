"""Who is calling, and which companies' objects they may see.

`Actor` is the caller in the terms services understand (an agent of one company, or a board
member of some companies, or a superuser board member of all). `scoped_get` is the one rule
for reading an object on a caller's behalf: another company's object and a malformed id are
both a plain NotFoundError (404), so nothing reveals what exists elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal
from uuid import UUID

from django.contrib.auth.models import AbstractBaseUser
from django.db import models

from paperclip.errors import NotFoundError
from paperclip.ids import parse_uuid
from paperclip.models import Agent, BoardMembership, Company


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
        return parse_uuid(company_id) in self.company_ids


def board_actor(user: Any) -> Actor:
    if user.is_superuser:
        return Actor(type="board", user=user, company_ids=None)
    ids = frozenset(BoardMembership.objects.filter(user=user).values_list("company_id", flat=True))
    return Actor(type="board", user=user, company_ids=ids)


def agent_actor(agent: Agent) -> Actor:
    return Actor(type="agent", agent=agent, company_ids=frozenset({agent.company_id}))


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
