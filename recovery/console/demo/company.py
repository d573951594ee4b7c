"""The demo company and who works in it: the board user, the company, its agents, execution
workspaces and issues (each made once, through the services), the agents' fresh keys, and the
reset that deletes it all."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import OutputWrapper
from django.db import connection, transaction

from paperclip import services
from paperclip.credentials import agent_key_create, agent_key_revoke
from paperclip.models import (
    Agent,
    AgentApiKey,
    BoardMembership,
    Company,
    ExecutionWorkspace,
    Issue,
)
from recovery.console.demo.plan import COMPANY_NAME, KEY_NAME, USERNAME


def demo_board_user(out: OutputWrapper, password: str) -> Any:
    """The demo's superuser, with `password` set afresh."""
    user_model = get_user_model()
    user, created = user_model.objects.get_or_create(
        **{user_model.USERNAME_FIELD: USERNAME},
        defaults={"is_staff": True, "is_superuser": True},
    )
    user.is_staff = True
    user.is_superuser = True
    user.is_active = True
    user.set_password(password)
    user.save()
    if created:
        out.write(f"Created board user {USERNAME} (staff, superuser)")
    return user


def demo_company(out: OutputWrapper, actor: Any, user: Any) -> Company:
    """The demo company (the oldest of that name), with `user` on its board."""
    company = Company.objects.filter(name=COMPANY_NAME).order_by("created_at", "pk").first()
    if company is None:
        company = services.company_create(actor=actor, name=COMPANY_NAME).company
        out.write(f"Created company {company.name} ({company.pk})")
    BoardMembership.objects.get_or_create(user=user, company=company)
    return company


def demo_agent(
    out: OutputWrapper, actor: Any, company: Company, name: str, role: str = Agent.Role.WORKER
) -> Agent:
    agent = Agent.objects.filter(company=company, name=name).order_by("created_at").first()
    if agent is None:
        agent = services.agent_create(
            actor=actor, company_id=company.pk, name=name, role=role
        ).agent
        out.write(f"Created agent {name} ({agent.pk}) [{role}]")
    return agent


def demo_workspace(
    out: OutputWrapper, actor: Any, company: Company, name: str, cwd: str
) -> ExecutionWorkspace:
    workspace = ExecutionWorkspace.objects.filter(company=company, name=name).first()
    if workspace is None:
        workspace = services.execution_workspace_create(
            actor=actor, company_id=company.pk, name=name, cwd=cwd
        ).workspace
        out.write(f"Created execution workspace {name} ({workspace.pk})")
    return workspace


def demo_issue(
    out: OutputWrapper,
    actor: Any,
    company: Company,
    title: str,
    status: str,
    agents: list[Agent],
    assignee: int | None,
) -> Issue:
    issue = Issue.objects.filter(company=company, title=title).first()
    if issue is None:
        issue = services.issue_create(
            actor=actor,
            company_id=company.pk,
            title=title,
            status=status,
            assignee_agent_id=agents[assignee].pk if assignee is not None else None,
        ).issue
        out.write(f"Created issue {title!r} [{status}]")
    return issue


def demo_key_fresh(agent: Agent, user_id: Any) -> str:
    """Revoke the agent's previous demo keys and mint one (its secret is shown only now)."""
    stale = AgentApiKey.objects.filter(agent=agent, name=KEY_NAME, revoked_at__isnull=True)
    for key_id in stale.order_by("pk").values_list("pk", flat=True):
        agent_key_revoke(key_id=key_id, actor_type="user", actor_id=str(user_id))
    return agent_key_create(
        agent_id=agent.pk, actor_type="user", actor_id=str(user_id), name=KEY_NAME
    ).secret


def demo_reset(out: OutputWrapper, root: Path) -> None:
    """Delete every demo company with everything in it (its rows cascade), the jobs still
    waiting for them, and the demo's files under `root`; the seed that follows builds it all
    again."""
    companies = list(Company.objects.filter(name=COMPANY_NAME).values_list("pk", flat=True))
    with transaction.atomic():
        for company_id in companies:
            with connection.cursor() as cursor:
                # A waiting job of a deleted run would only fail: nothing to do any more.
                cursor.execute(
                    "DELETE FROM procrastinate_jobs WHERE status = 'todo'"
                    " AND args->>'company_id' = %s",
                    [str(company_id)],
                )
            Company.objects.filter(pk=company_id).delete()
    shutil.rmtree(root, ignore_errors=True)
    out.write(f"Reset: deleted {len(companies)} demo company(ies) and {root}")
