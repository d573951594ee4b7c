"""Writes of companies, agents and agent keys.

Board-only (a superuser for a new company); another company's objects answer NotFoundError
(404), exactly like missing ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from uuid import UUID

from django.db import transaction

from paperclip import selectors
from paperclip.access import Actor
from paperclip.credentials import CredentialRevocation, IssuedCredential, agent_key_create
from paperclip.credentials import agent_key_revoke as _credential_agent_key_revoke
from paperclip.errors import PermissionDenied
from paperclip.models import Agent, BoardMembership, Company
from paperclip.services.shared import audit, require_board


@dataclass(frozen=True, slots=True)
class CompanyCreated:
    company: Company


def company_create(*, actor: Actor, name: str) -> CompanyCreated:
    """Create a company and make the creating (superuser) board user a member of it.

    Raises PermissionDenied unless the actor is a superuser board member.
    """
    if not actor.is_superuser or actor.user is None:
        raise PermissionDenied("Only superusers may create companies.")
    with transaction.atomic(durable=True):
        company = Company.objects.create(name=name)
        BoardMembership.objects.create(user_id=actor.user.pk, company=company)
        audit(
            actor,
            company_id=company.pk,
            action="company.created",
            entity_type="company",
            entity_id=company.pk,
            details={"name": name, "board_member_user_id": str(actor.user.pk)},
        )
    return CompanyCreated(company=company)


@dataclass(frozen=True, slots=True)
class AgentCreated:
    agent: Agent


def agent_create(
    *, actor: Actor, company_id: UUID | str, name: str, role: str = Agent.Role.WORKER
) -> AgentCreated:
    """Create an agent in a company the board actor belongs to; `role` is `worker` (runs
    issues) or `provider` (drives environment leases and their cleanups).

    Raises PermissionDenied (not a board actor) or NotFoundError (company not visible).
    """
    require_board(actor)
    company = selectors.company_get(actor=actor, company_id=company_id)
    with transaction.atomic(durable=True):
        agent = Agent.objects.create(company=company, name=name, role=role)
        audit(
            actor,
            company_id=company.pk,
            action="agent.created",
            entity_type="agent",
            entity_id=agent.pk,
            details={"name": name, "role": role},
        )
    return AgentCreated(agent=agent)


def agent_key_issue(*, actor: Actor, agent_id: UUID | str, name: str = "") -> IssuedCredential:
    """Mint an API key for an agent of the board actor's company; the secret is returned once.

    Raises PermissionDenied (not a board actor) or NotFoundError (agent not visible).
    """
    require_board(actor)
    agent = selectors.agent_get(actor=actor, agent_id=agent_id)
    return agent_key_create(
        agent_id=agent.pk, actor_type=actor.actor_type, actor_id=actor.actor_id, name=name
    )


def agent_key_revoke(*, actor: Actor, key_id: UUID | str) -> CredentialRevocation:
    """Revoke an agent key (idempotent). Locks the key row.

    Raises PermissionDenied (not a board actor) or NotFoundError (key not visible).
    """
    require_board(actor)
    key = selectors.agent_key_get(actor=actor, key_id=key_id)
    return _credential_agent_key_revoke(
        key_id=key.pk, actor_type=actor.actor_type, actor_id=actor.actor_id
    )
