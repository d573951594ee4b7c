"""`manage.py seed_demo`: a demo company to click around in, safe to run any number of times.

It makes (once) a company, two agents, three execution workspaces, issues in several statuses and
a few runs (one native run running and holding its issue), all through the services, so the audit
log tells the story. One native run has posted its result, but its finalization controller died
in the middle of a copy-back (simulated: its owner receipt names a process of this host that has
exited): the worker holds that run for the board, and confirming the owner stop in the admin lets
the worker commit it a moment later. Another native run's export into its workspace failed on
every attempt (the archive workspace's cwd lies under a regular file, a stand-in for a full
disk): it is held for the board's repair, and removing that file, then "Retry workspace
export", lets the worker commit it. One runtime lease outlives its issue (closed after the
claim): it is stale until the worker's sweep deletes it. Both show on the admin's dashboard.
A provider agent drives environment leases of a demo sandbox environment through the lifecycle
services, one in each interesting state (see `ENVIRONMENT_LEASES`): active, pending cleanup,
claimed, a cleanup whose last attempt failed and set no back-off (the worker never reopens it:
it waits for the board's "Retry cleanup now", docs/setup.md#the-demo), a
claim that ran out without a receipt, retained with an export-resume marker, a stop-only marker
that does not bind (an operator must look), released for reuse, and cleaned up; plus a failed
native run whose retained sandbox its recovery action records as the workspace source (the
recovery action's page inspects it).
Every run prints an admin login and three working agent keys (two workers, one provider):
the password is reset and each agent's previous `seed_demo` key is revoked before a fresh one is
minted (secrets are stored hashed, so the old ones cannot be printed again). Each step is its own
durable service call, so an interrupted seed is consistent and the next run completes it.
The steps live in `recovery/console/demo/`; this command parses the options and runs them.
"""

from __future__ import annotations

import secrets
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from paperclip.access import board_actor
from paperclip.models import Agent, HeartbeatRun
from recovery.console.demo.company import (
    demo_agent,
    demo_board_user,
    demo_company,
    demo_issue,
    demo_key_fresh,
    demo_reset,
    demo_workspace,
)
from recovery.console.demo.environment import demo_environment_leases
from recovery.console.demo.plan import AGENTS, HELD_WORKDIR, ISSUES, PROVIDER, WORKSPACES, demo_dir
from recovery.console.demo.runs import demo_runs
from recovery.console.demo.summary import DemoLogins, demo_summary
from recovery.services.copyback_guard import copyback_source_refusal


class Command(BaseCommand):
    help = "Create (or refresh) the demo company and print an admin login and three agent keys."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--password", default="", help="Admin password for demo-board (default: random)."
        )
        parser.add_argument(
            "--reset",
            action="store_true",
            help="Delete the demo company and everything in it first, then seed it afresh: "
            "every seeded state is back (`make demo-reset`).",
        )
        parser.add_argument(
            "--url",
            default="http://127.0.0.1:8000",
            help="The server's address, for the commands printed at the end.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        root = demo_dir()
        # Two of the demo's runs are copied back from their directories (the legacy copy-back),
        # which reads only under PAPERCLIP_COPYBACK_ROOTS (docs/security.md#the-legacy-copy-back).
        # A check of the settings alone (the demo company may not exist yet): no company's
        # run directories are compared.
        refusal = copyback_source_refusal(str(root / HELD_WORKDIR), company_id=None)
        if refusal is not None:
            raise CommandError(
                f"The demo's runs are copied back from {root}, which the legacy "
                f"copy-back refuses ({refusal}): set PAPERCLIP_COPYBACK_ROOTS={root} "
                "(make run and make demo-reset do)."
            )
        out = self.stdout
        if options["reset"]:
            demo_reset(out, root)
        password = options["password"] or secrets.token_urlsafe(12)
        user = demo_board_user(out, password)
        actor = board_actor(user)
        company = demo_company(out, actor, user)

        agents = [demo_agent(out, actor, company, name) for name in AGENTS]
        provider = demo_agent(out, actor, company, PROVIDER, role=Agent.Role.PROVIDER)
        workspaces = [
            demo_workspace(out, actor, company, name, str(root / cwd)) for name, cwd in WORKSPACES
        ]
        issues = {
            title: demo_issue(out, actor, company, title, status, agents, assignee)
            for title, status, assignee in ISSUES
        }
        if not HeartbeatRun.objects.filter(company=company).exists():
            demo_runs(out, root, actor, agents, workspaces, issues)

        demo_environment_leases(out, actor, company, provider, workspaces)

        keys = [demo_key_fresh(agent, user.pk) for agent in [*agents, provider]]

        out.write("")
        logins = DemoLogins(
            company=company,
            password=password,
            agents=[*agents, provider],
            keys=keys,
            workspaces=workspaces,
            issues=issues,
        )
        path = demo_summary(out, root, options["url"].rstrip("/"), logins)
        out.write(f"(saved to {path}: the logins stay there when the log scrolls)")
