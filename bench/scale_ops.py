"""bench/scale.py's operations: the bench's own rows (agent, key, workspaces to claim,
board and staff users) and what is timed over them: claims, renews, sweeps, console pages."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from scale_fixture import AGENTS, COMPANIES, connection_cursor
from scale_measure import Op

# The staff user is a board member of this many companies (and the bench's own): a tenth of
# the scale fixture, and every row of the small database (so its pages there are full too).
STAFF_COMPANIES = 10
STALE_SMALL = 10
STALE_LARGE = 1000


class Bench:
    """The bench's own rows (present in both phases) and the operations over them."""

    def __init__(self, **rows: Any) -> None:
        self.__dict__.update(rows)

    @classmethod
    def create(cls) -> Bench:
        from django.contrib.auth import get_user_model
        from django.contrib.auth.models import Permission

        from paperclip.credentials import agent_key_create
        from paperclip.models import (
            Agent,
            BoardMembership,
            Company,
            ExecutionWorkspace,
            HeartbeatRun,
        )

        with connection_cursor() as cursor:
            cursor.execute(
                "INSERT INTO companies (id, name) SELECT md5('company' || c)::uuid,"
                " 'company ' || c FROM generate_series(0, %s) c",
                [COMPANIES - 1],
            )
            cursor.execute(
                "INSERT INTO agents (id, company_id, name, status) SELECT md5('agent' || a)::uuid,"
                " md5('company' || (a %% %s))::uuid, 'agent ' || a, 'active'"
                " FROM generate_series(0, %s) a",
                [COMPANIES, AGENTS - 1],
            )
        company = Company.objects.create(name="bench")
        agent = Agent.objects.create(company=company, name="bench-agent")
        # One fresh workspace per claim (warm-up and repeats of both phases, with room).
        fresh = iter(
            ExecutionWorkspace.objects.bulk_create(
                ExecutionWorkspace(company=company, name=f"claim-{i}") for i in range(200)
            )
        )
        renew_ws = ExecutionWorkspace.objects.create(company=company, name="renew")
        http_ws = ExecutionWorkspace.objects.create(company=company, name="http-renew")
        stale_pool = ExecutionWorkspace.objects.bulk_create(
            ExecutionWorkspace(company=company, name=f"stale-{i}") for i in range(STALE_LARGE)
        )
        ended = HeartbeatRun.objects.create(company=company, agent=agent, status="failed")
        user_model = get_user_model()
        board = user_model.objects.create_user(
            username="board", password=None, is_staff=True, is_superuser=True
        )
        staff = user_model.objects.create_user(username="staff", password=None, is_staff=True)
        staff.user_permissions.set(Permission.objects.all())
        for scoped in (
            company,
            *Company.objects.filter(name__in=[f"company {c}" for c in range(STAFF_COMPANIES)]),
        ):
            BoardMembership.objects.create(user=staff, company=scoped)
        return cls(
            company=company,
            agent=agent,
            fresh=fresh,
            renew_ws=renew_ws,
            http_ws=http_ws,
            stale_pool=stale_pool,
            ended=ended,
            board=board,
            staff=staff,
            secret=agent_key_create(agent_id=agent.pk).secret,
        )

    def claim(self, workspace_id: Any, expect: str) -> None:
        from leases.services import RuntimeLeaseOwner, runtime_lease_claim

        outcome = runtime_lease_claim(
            company_id=self.company.pk,
            execution_workspace_id=workspace_id,
            action="start",
            owner=RuntimeLeaseOwner.for_agent(self.agent.pk),
        ).outcome
        assert outcome == expect, outcome

    def make_stale(self, count: int) -> None:
        """`count` stale leases on the bench's pool: half expired, half held by an ended run."""
        from leases.models import WorkspaceRuntimeLease

        pool = self.stale_pool[:count]
        WorkspaceRuntimeLease.objects.filter(execution_workspace__in=pool).delete()
        rows = []
        for i, workspace in enumerate(pool):
            expired = i % 2 == 0
            rows.append(
                WorkspaceRuntimeLease(
                    company=self.company,
                    execution_workspace=workspace,
                    owner_key=f"agent:{self.agent.pk}" if expired else f"run:{self.ended.pk}",
                    owner_agent=self.agent,
                    owner_run=None if expired else self.ended,
                    last_action="start",
                    expires_at=_minutes_from_now(-5 if expired else 30),
                )
            )
        WorkspaceRuntimeLease.objects.bulk_create(rows)

    def sweep_op(self, stale: int) -> Op:
        from leases.services import runtime_lease_sweep

        def sweep() -> None:
            report = runtime_lease_sweep()
            assert report.deleted == stale, (report.deleted, stale)

        return Op("sweep", f"sweep, {stale} stale", sweep, setup=lambda: self.make_stale(stale))

    def ops(self) -> list[Op]:
        from django.contrib import admin
        from django.test import Client
        from django.urls import reverse

        self.claim(self.renew_ws.pk, "created")
        board, staff, agent_client = Client(), Client(), Client()
        board.force_login(self.board)
        staff.force_login(self.staff)
        claim_url = reverse("runtime-lease-claim", args=[self.http_ws.pk])
        auth = {"HTTP_AUTHORIZATION": f"Bearer {self.secret}"}
        body = json.dumps({"action": "start"})
        agent_client.post(claim_url, body, content_type="application/json", **auth)

        def http_renew() -> None:
            response = agent_client.post(claim_url, body, content_type="application/json", **auth)
            assert response.status_code == 200, response.content
            assert response.json()["outcome"] == "renewed", response.content

        ops = [
            Op(
                "claim",
                "claim (created), service",
                lambda: self.claim(next(self.fresh).pk, "created"),
            ),
            Op("renew", "renew, service", lambda: self.claim(self.renew_ws.pk, "renewed")),
            Op("http_renew", "renew, HTTP", http_renew),
            self.sweep_op(STALE_SMALL),
        ]
        pages = [
            ("dashboard", reverse("admin:index")),
            ("attention", reverse("admin:console_attention")),
        ]
        for model in admin.site._registry:
            opts = model._meta
            url = reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist")
            pages.append((f"{opts.app_label}.{opts.model_name}", url))
            for query in _COMMON_FILTERS.get(opts.db_table, ()):
                pages.append((f"{opts.app_label}.{opts.model_name}?{query}", f"{url}?{query}"))
        for who, client in (("board", board), ("staff", staff)):
            for name, url in pages:
                if client is staff and not _staff_may_open(url, client):
                    continue
                ops.append(Op(f"{who}:{name}", f"{name} ({who})", _page(client, url)))
        return ops


# Filters operators use most: the dashboard tiles' links and the obvious first clicks.
_COMMON_FILTERS: dict[str, tuple[str, ...]] = {
    "execution_workspace_runtime_leases": ("staleness=stale", "stale_reason=lease_expired"),
    "activity_events": ("action=runtime_lease.swept", "entity_type=issue"),
    "heartbeat_runs": ("status__exact=running",),
    "issue_recovery_actions": ("status__exact=active", "hold=board"),
    "native_run_finalizations": ("attention=failed",),
}


def _page(client: Any, url: str) -> Callable[[], None]:
    def get() -> None:
        response = client.get(url)
        assert response.status_code == 200, (url, response.status_code)
        response.content  # noqa: B018 (a TemplateResponse renders when read)

    return get


def _staff_may_open(url: str, client: Any) -> bool:
    import logging

    quiet = logging.getLogger("django.request")
    level, quiet.level = quiet.level, logging.ERROR  # the 403s of superuser-only pages
    try:
        return bool(client.get(url).status_code == 200)
    finally:
        quiet.level = level


def _minutes_from_now(minutes: int) -> Any:
    from datetime import timedelta

    from django.utils import timezone

    return timezone.now() + timedelta(minutes=minutes)
