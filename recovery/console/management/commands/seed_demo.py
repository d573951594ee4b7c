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
"""

from __future__ import annotations

import secrets
import shutil
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser, OutputWrapper
from django.db import connection, transaction

from leases.environment.lifecycle import (
    environment_create,
    environment_lease_acquire,
    environment_lease_release,
)
from leases.environment.services import (
    environment_lease_cleanup_claim,
    environment_lease_cleanup_settle,
)
from leases.models import EnvironmentLease
from leases.services import RuntimeLeaseOwner, runtime_lease_claim
from paperclip import services
from paperclip.access import Actor, agent_actor, board_actor
from paperclip.activity import row_update_audited
from paperclip.credentials import agent_key_create, agent_key_revoke
from paperclip.db.clock import db_now, db_now_iso
from paperclip.host import kernel_boot_id
from paperclip.models import (
    Agent,
    AgentApiKey,
    BoardMembership,
    Company,
    Environment,
    ExecutionWorkspace,
    HeartbeatRun,
    Issue,
    NativeRunFinalization,
    NativeRunResult,
)
from paperclip.receipts import OWNER_KEY
from recovery.models import IssueRecoveryAction
from recovery.selectors.source.inspection import HISTORICAL_SOURCE_SCHEMA
from recovery.services import result_accept
from recovery.services.actions import RecoveryActionInput, recovery_action_upsert_source_scoped
from recovery.services.copyback_guard import copyback_source_refusal
from recovery.services.export_repair import export_hold_in_tx

COMPANY_NAME = "Demo Company"
USERNAME = "demo-board"
KEY_NAME = "seed_demo"
AGENTS = ("demo-agent-alpha", "demo-agent-beta")
PROVIDER = "demo-provider"
ENVIRONMENT = "demo-sandboxes"
SANDBOX_PROVIDER = "demo-sandbox"
SANDBOX_PLUGIN = "plugin-demo-sandbox"
# The demo's files live under the data directory, so two checkouts on one machine keep theirs
# apart (docs/setup.md#the-demo); the printed logins are saved there too.
WORKSPACES = (
    ("demo-workspace-main", "main"),
    ("demo-workspace-review", "review"),
    ("demo-workspace-export", "export"),
    ("demo-workspace-archive", "archive/repo"),
)
LOGINS_FILE = "logins.txt"
HELD_TITLE = "Publish the nightly export"
# The README's agent quickstart: paperclip-agent runs a command for this issue in this workspace.
CLI_ISSUE = "Fix the flaky lease test"
CLI_WORKDIR = "agent-run"
# The provider worker's guide (docs/environment.md#provider-workers-guide) leases a sandbox to
# this issue's running run.
PROVIDER_RUN_ISSUE = "Encrypt runner checkpoints"
STALE_TITLE = "Retire the staging sandbox"
# A failed native run whose retained sandbox lease is a recovery source the console can inspect.
SOURCE_TITLE = "Rebuild the sandbox image"
SOURCE_ALLOCATION = "sbx-demo-source"
HELD_WORKDIR = "export-run"  # the runner's directory
# A run whose export into its workspace failed on every attempt: the archive workspace's cwd
# sits under a regular file (a stand-in for a full or read-only disk) until the board "repairs"
# it by removing that file, then retries the export.
EXPORT_HELD_TITLE = "Archive the build logs"
EXPORT_HELD_WORKDIR = "archive-run"
EXPORT_BLOCKER = "archive"
# (title, status, assignee index or None)
ISSUES = (
    ("Set up the CI pipeline", Issue.Status.BACKLOG, None),
    ("Fix the flaky lease test", Issue.Status.TODO, 0),
    ("Encrypt runner checkpoints", Issue.Status.IN_PROGRESS, 0),
    ("Review the finalization runbook", Issue.Status.IN_REVIEW, 1),
    ("Upgrade the PostgreSQL driver", Issue.Status.BLOCKED, 1),
    ("Ship runtime leases", Issue.Status.DONE, 0),
    ("Drop the legacy runner", Issue.Status.CANCELLED, None),
    (HELD_TITLE, Issue.Status.IN_PROGRESS, 1),
    (STALE_TITLE, Issue.Status.IN_PROGRESS, 0),
    (SOURCE_TITLE, Issue.Status.BLOCKED, 1),
    (EXPORT_HELD_TITLE, Issue.Status.IN_PROGRESS, 0),
)
# One environment lease per interesting state, keyed by its allocation id (what makes the step
# idempotent): (provider_lease_id, the run's issue title, policy, workspace index or None,
# release outcome or None, the steps after the release, marker to write before it).
ENVIRONMENT_LEASES: tuple[
    tuple[str, str, str, int | None, str | None, tuple[str, ...], str], ...
] = (
    ("sbx-demo-active", "Encrypt runner checkpoints", "ephemeral", 0, None, (), ""),
    ("sbx-demo-pending", "Ship runtime leases", "ephemeral", None, "succeeded", (), ""),
    (
        "sbx-demo-claimed",
        "Upgrade the PostgreSQL driver",
        "ephemeral",
        None,
        "failed",
        ("claim",),
        "",
    ),
    (
        "sbx-demo-failed",
        "Upgrade the PostgreSQL driver",
        "ephemeral",
        None,
        "failed",
        ("claim", "failed", "for_the_board"),
        "",
    ),
    (
        "sbx-demo-overdue",
        "Review the finalization runbook",
        "ephemeral",
        1,
        "succeeded",
        ("claim", "overdue"),
        "",
    ),
    ("sbx-demo-retained", HELD_TITLE, "retain_on_failure", 2, "failed", (), "valid"),
    (
        "sbx-demo-bad-marker",
        "Review the finalization runbook",
        "ephemeral",
        None,
        "succeeded",
        (),
        "invalid",
    ),
    ("sbx-demo-reused", "Ship runtime leases", "reuse_by_environment", None, "succeeded", (), ""),
    (
        "sbx-demo-cleaned",
        "Ship runtime leases",
        "ephemeral",
        None,
        "succeeded",
        ("claim", "destroyed"),
        "",
    ),
)


class Command(BaseCommand):
    help = "Create (or refresh) the demo company and print an admin login and two agent keys."

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
        self.demo_dir = demo_dir()
        # Two of the demo's runs are copied back from their directories (the legacy copy-back),
        # which reads only under PAPERCLIP_COPYBACK_ROOTS (docs/security.md#the-legacy-copy-back).
        refusal = copyback_source_refusal(str(self.demo_dir / HELD_WORKDIR))
        if refusal is not None:
            raise CommandError(
                f"The demo's runs are copied back from {self.demo_dir}, which the legacy "
                f"copy-back refuses ({refusal}): set PAPERCLIP_COPYBACK_ROOTS={self.demo_dir} "
                "(make run and make demo-reset do)."
            )
        if options["reset"]:
            self._reset()
        password = options["password"] or secrets.token_urlsafe(12)
        user = self._board_user(password)
        actor = board_actor(user)

        company = Company.objects.filter(name=COMPANY_NAME).order_by("created_at", "pk").first()
        if company is None:
            company = services.company_create(actor=actor, name=COMPANY_NAME).company
            self.stdout.write(f"Created company {company.name} ({company.pk})")
        BoardMembership.objects.get_or_create(user=user, company=company)

        agents = [self._agent(actor, company, name) for name in AGENTS]
        provider = self._agent(actor, company, PROVIDER, role=Agent.Role.PROVIDER)
        workspaces = [
            self._workspace(actor, company, name, str(self.demo_dir / cwd))
            for name, cwd in WORKSPACES
        ]
        issues = {
            title: self._issue(actor, company, title, status, agents, assignee)
            for title, status, assignee in ISSUES
        }
        if not HeartbeatRun.objects.filter(company=company).exists():
            self._runs(actor, agents, workspaces, issues)

        self._environment_leases(actor, company, provider, workspaces)

        keys = [self._fresh_key(agent, user.pk) for agent in [*agents, provider]]

        self.stdout.write("")
        summary = _Summary(self.stdout)
        summary.write(f"Demo company: {company.name} ({company.pk})")
        summary.write(f"Admin login:  /admin/  user {USERNAME}  password {password}")
        for agent, key in zip([*agents, provider], keys, strict=True):
            role = " (provider)" if agent.role == Agent.Role.PROVIDER else ""
            summary.write(f"Agent {agent.name} ({agent.pk}){role} key: {key}")
        url = options["url"].rstrip("/")
        summary.write(f"Try: curl -H 'Authorization: Bearer <key>' {url}/api/me")
        environment = Environment.objects.filter(company=company, name=ENVIRONMENT).first()
        run = (
            HeartbeatRun.objects.filter(company=company, issue=issues[PROVIDER_RUN_ISSUE])
            .order_by("created_at", "pk")
            .first()
        )
        if environment is not None and run is not None:
            summary.write(
                "Provider worker, in another terminal (docs/environment.md, its worker's guide):"
            )
            summary.write(
                f"  export PAPERCLIP_URL={url} PROVIDER_KEY={keys[-1]}"
                f" ENV_ID={environment.pk} RUN_ID={run.pk}"
            )
        alpha, main, issue = agents[0], workspaces[0], issues[CLI_ISSUE]
        summary.write("Agent CLI, in another terminal (README: Agent quickstart):")
        summary.write(
            f"  export PAPERCLIP_URL={url} PAPERCLIP_AGENT_KEY=$(.venv/bin/python manage.py"
            f" create_agent_key --agent {alpha.pk} | tail -n 1)"
        )
        summary.write(
            f"  .venv/bin/paperclip-agent run --workspace {main.pk} --issue {issue.pk}"
            f" --workdir {self.demo_dir / CLI_WORKDIR} -- sh -c 'echo hi > out.txt'"
        )
        path = self.demo_dir / LOGINS_FILE
        summary.save(path)
        self.stdout.write(f"(saved to {path}: the logins stay there when the log scrolls)")

    def _board_user(self, password: str) -> Any:
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
            self.stdout.write(f"Created board user {USERNAME} (staff, superuser)")
        return user

    def _agent(
        self, actor: Any, company: Company, name: str, role: str = Agent.Role.WORKER
    ) -> Agent:
        agent = Agent.objects.filter(company=company, name=name).order_by("created_at").first()
        if agent is None:
            agent = services.agent_create(
                actor=actor, company_id=company.pk, name=name, role=role
            ).agent
            self.stdout.write(f"Created agent {name} ({agent.pk}) [{role}]")
        return agent

    def _workspace(self, actor: Any, company: Company, name: str, cwd: str) -> ExecutionWorkspace:
        workspace = ExecutionWorkspace.objects.filter(company=company, name=name).first()
        if workspace is None:
            workspace = services.execution_workspace_create(
                actor=actor, company_id=company.pk, name=name, cwd=cwd
            ).workspace
            self.stdout.write(f"Created execution workspace {name} ({workspace.pk})")
        return workspace

    def _issue(
        self,
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
            self.stdout.write(f"Created issue {title!r} [{status}]")
        return issue

    def _runs(
        self,
        actor: Any,
        agents: list[Agent],
        workspaces: list[ExecutionWorkspace],
        issues: dict[str, Issue],
    ) -> None:
        alpha, beta = agents
        main, review, export, archive = workspaces
        plan: list[tuple[Agent, str, str, ExecutionWorkspace | None, list[str]]] = [
            (alpha, "legacy", "Ship runtime leases", None, ["running", "succeeded"]),
            (alpha, "native", "Encrypt runner checkpoints", main, ["running"]),
            (beta, "native", "Review the finalization runbook", review, []),
            (beta, "legacy", "Upgrade the PostgreSQL driver", None, ["running", "failed"]),
        ]
        for agent, mode, title, workspace, steps in plan:
            run = services.run_create(
                actor=actor,
                agent_id=agent.pk,
                runtime_mode=mode,
                issue_id=issues[title].pk,
                execution_workspace_id=workspace.pk if workspace else None,
                workspace_dir=workspace.cwd if workspace else None,
            ).run
            for step in steps:
                run = services.run_transition(actor=actor, run_id=run.pk, to_status=step).run
            self.stdout.write(f"Created {mode} run {run.pk} for {title!r} [{run.status}]")
        self._held_run(actor, beta, export, issues[HELD_TITLE])
        self._held_export(actor, alpha, archive, issues[EXPORT_HELD_TITLE])
        self._stale_lease(actor, alpha, review, issues[STALE_TITLE])

    def _stale_lease(
        self, actor: Any, agent: Agent, workspace: ExecutionWorkspace, issue: Issue
    ) -> None:
        """A runtime lease whose issue was closed while it held the lane: stale
        (`owner_issue_terminal`) until the next claim, the sweep or the board releases it."""
        runtime_lease_claim(
            company_id=issue.company_id,
            execution_workspace_id=workspace.pk,
            action="start",
            owner=RuntimeLeaseOwner.for_agent(agent.pk, issue_id=issue.pk),
            ttl_seconds=86400,
        )
        services.issue_update(actor=actor, issue_id=issue.pk, status=Issue.Status.DONE)
        self.stdout.write(
            f"Claimed the runtime lease of {workspace.name} for {issue.title!r}, then closed the "
            "issue: the lease is stale (owner_issue_terminal) until swept or force-released"
        )

    def _native_running(
        self,
        actor: Any,
        agent: Agent,
        workspace: ExecutionWorkspace,
        issue: Issue,
        workdir: Path,
    ) -> HeartbeatRun:
        """A native run of `agent` on `issue`, started, with `workdir` as its directory."""
        run = services.run_create(
            actor=actor,
            agent_id=agent.pk,
            runtime_mode="native",
            issue_id=issue.pk,
            execution_workspace_id=workspace.pk,
            workspace_dir=str(workdir),
        ).run
        return services.run_transition(actor=actor, run_id=run.pk, to_status="running").run

    def _held_run(
        self, actor: Any, agent: Agent, workspace: ExecutionWorkspace, issue: Issue
    ) -> None:
        """A native run whose result is accepted while the receipt of a controller that died
        mid copy-back is still recorded: the worker will hold it for the board."""
        workdir = self.demo_dir / HELD_WORKDIR
        (workdir / "out").mkdir(parents=True, exist_ok=True)
        (workdir / "out" / "export.csv").write_text("id,total\n1,42\n")
        (workdir / "README.md").write_text("Nightly export produced by demo-agent-beta.\n")
        run = self._native_running(actor, agent, workspace, issue, workdir)
        # A real process of this host that has exited: its receipt can't be proven stopped
        # mid copy-back (no barrier), which is exactly what the board must confirm.
        gone = subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"],
            capture_output=True,
            text=True,
            check=True,
        )
        receipt = {
            "token": str(uuid.uuid4()),
            "controllerBootId": str(uuid.uuid4()),
            "hostname": socket.gethostname(),
            "pid": int(gone.stdout),
            "processStartedAt": db_now_iso(),
        }
        boot = kernel_boot_id()
        if boot is not None:  # this host and boot, as a real receipt says
            receipt["kernelBootId"] = boot
        with transaction.atomic():
            row_update_audited(
                run,
                {"runner_profile_json": {**(run.runner_profile_json or {}), OWNER_KEY: receipt}},
                company_id=run.company_id,
                actor_type="system",
                actor_id="seed_demo",
                action="run.finalization_owner_claimed",
                entity_type="heartbeat_run",
                entity_id=run.pk,
                run_id=run.pk,
                details={"owner": receipt, "simulated": "a controller that died mid copy-back"},
            )
        result_accept(
            company_id=run.company_id,
            run_id=run.pk,
            agent_id=agent.pk,
            result={"summary": "exported 1 row"},
            run_terminal_state="succeeded",
            caller_result_id="seed-demo-export",
        )
        self.stdout.write(
            f"Created native run {run.pk} for {issue.title!r}: result accepted, its controller "
            "gone mid copy-back; the worker holds it for the board (admin: Issue recovery actions)"
        )

    def _held_export(
        self, actor: Any, agent: Agent, workspace: ExecutionWorkspace, issue: Issue
    ) -> None:
        """A native run whose export into its workspace fails for real on every attempt (the
        cwd's parent is a regular file): the finalizer's attempts spend the retry budget and the
        board gets the hold whose button is "Retry workspace export"."""
        workdir = self.demo_dir / EXPORT_HELD_WORKDIR
        (workdir / "logs").mkdir(parents=True, exist_ok=True)
        (workdir / "logs" / "build-1042.log").write_text("build 1042: ok (3 m 12 s)\n")
        blocker = self.demo_dir / EXPORT_BLOCKER
        if not blocker.is_file():
            shutil.rmtree(blocker, ignore_errors=True)
            blocker.write_text(
                "A stand-in for a full disk: the archive workspace's cwd cannot be created under "
                "this file. Remove it, then use Retry workspace export on the held run.\n"
            )
        run = self._native_running(actor, agent, workspace, issue, workdir)
        result_accept(
            company_id=run.company_id,
            run_id=run.pk,
            agent_id=agent.pk,
            result={"summary": "archived 1 build log"},
            run_terminal_state="succeeded",
            caller_result_id="seed-demo-archive",
        )
        # The worker's attempts over its back-off (about 8 minutes), already spent: the last
        # one's failure is what the next attempt meets for real while the blocker is there.
        attempts = int(settings.PAPERCLIP_FINALIZE_MAX_ATTEMPTS)
        detail = f"[Errno 20] Not a directory: '{workspace.cwd}'"
        with transaction.atomic():
            coordinator = NativeRunFinalization.objects.get(run_id=run.pk)
            row_update_audited(
                coordinator,
                {
                    "phase": NativeRunFinalization.Phase.RETRYABLE_FAILURE,
                    "attempt": attempts,
                    "failure_code": "workspace_copyback_retry_exhausted",
                    "failure_detail": {
                        "workspaceFinalizeAttempt": attempts,
                        "code": "copyback_io_error",
                        "detail": detail,
                    },
                    "next_attempt_at": None,
                },
                company_id=run.company_id,
                actor_type="system",
                actor_id="seed_demo",
                action="run.workspace_finalize_retry_exhausted",
                entity_type="heartbeat_run",
                entity_id=run.pk,
                run_id=run.pk,
                details={"simulated": f"{attempts} failed export attempts", "detail": detail},
            )
            export_hold_in_tx(
                issue=issue,
                run=HeartbeatRun.objects.get(pk=run.pk),
                coordinator=coordinator,
                failure={"code": "copyback_io_error", "detail": detail, "attempts": attempts},
            )
        self.stdout.write(
            f"Created native run {run.pk} for {issue.title!r}: its export failed on every "
            f"attempt; remove {blocker} and use Retry workspace export (admin: the run's page)"
        )

    def _environment_leases(
        self,
        actor: Actor,
        company: Company,
        provider: Agent,
        workspaces: list[ExecutionWorkspace],
    ) -> None:
        """The demo environment and one lease per state of `ENVIRONMENT_LEASES`, made by the
        provider agent through the lifecycle and cleanup services (the audit log tells it)."""
        environment = Environment.objects.filter(company=company, name=ENVIRONMENT).first()
        if environment is None:
            environment = environment_create(
                actor=actor,
                company_id=company.pk,
                name=ENVIRONMENT,
                driver=Environment.Driver.SANDBOX,
                config={"image": "paperclip-demo:latest"},
            ).environment
            self.stdout.write(f"Created environment {ENVIRONMENT} ({environment.pk})")
        worker = agent_actor(provider)
        self._recovery_source(actor, worker, company, environment)
        for allocation, title, policy, ws, outcome, steps, marker in ENVIRONMENT_LEASES:
            if EnvironmentLease.objects.filter(
                company=company, provider_lease_id=allocation
            ).exists():
                continue
            run = (
                HeartbeatRun.objects.filter(company=company, issue__title=title)
                .order_by("created_at", "pk")
                .first()
            )
            if run is None:
                continue
            lease = environment_lease_acquire(
                actor=worker,
                environment_id=environment.pk,
                heartbeat_run_id=run.pk,
                execution_workspace_id=workspaces[ws].pk if ws is not None else None,
                lease_policy=policy,
                provider=SANDBOX_PROVIDER,
                provider_lease_id=allocation,
                remote_cwd="/home/sandbox/work",
                plugin_id=SANDBOX_PLUGIN,
            ).lease
            if marker:
                self._export_marker(lease, valid=marker == "valid")
            if outcome is not None:
                lease = environment_lease_release(
                    actor=worker,
                    lease_id=lease.pk,
                    outcome=outcome,  # type: ignore[arg-type]
                ).lease
            attempt = ""
            for step in steps:
                if step == "claim":
                    attempt = environment_lease_cleanup_claim(
                        lease_id=lease.pk,
                        company_id=company.pk,
                        actor_type=worker.actor_type,
                        actor_id=worker.actor_id,
                    ).attempt_id
                elif step == "overdue":
                    self._claim_ran_out(lease.pk)
                elif step == "for_the_board":
                    self._left_for_the_board(lease.pk)
                else:
                    environment_lease_cleanup_settle(
                        lease_id=lease.pk,
                        company_id=company.pk,
                        attempt_id=attempt,
                        provider_lease_id=allocation,
                        state=step,  # type: ignore[arg-type]
                        actor_type=worker.actor_type,
                        actor_id=worker.actor_id,
                    )
            lease.refresh_from_db()
            self.stdout.write(
                f"Environment lease {allocation} ({lease.pk}) for {title!r}: {lease.status}"
                f" (cleanup {lease.cleanup_status or '-'})"
            )

    def _recovery_source(
        self, actor: Actor, worker: Actor, company: Company, environment: Environment
    ) -> None:
        """A native run of `SOURCE_TITLE` that failed while a provider held a
        `retain_on_failure` sandbox for it (released `failed`: retained), and the recovery
        action that recorded that lease as its workspace source: the recovery action's page
        inspects it (`recovery_source_inspect`) with real data."""
        if EnvironmentLease.objects.filter(
            company=company, provider_lease_id=SOURCE_ALLOCATION
        ).exists():
            return
        issue = Issue.objects.get(company=company, title=SOURCE_TITLE)
        beta = Agent.objects.get(company=company, name=AGENTS[1])
        run = services.run_create(
            actor=actor, agent_id=beta.pk, runtime_mode="native", issue_id=issue.pk
        ).run
        services.run_transition(actor=actor, run_id=run.pk, to_status="running")
        lease = environment_lease_acquire(
            actor=worker,
            environment_id=environment.pk,
            heartbeat_run_id=run.pk,
            lease_policy=EnvironmentLease.Policy.RETAIN_ON_FAILURE,
            provider=SANDBOX_PROVIDER,
            provider_lease_id=SOURCE_ALLOCATION,
            remote_cwd="/home/sandbox/work",
            plugin_id=SANDBOX_PLUGIN,
        ).lease
        services.run_transition(actor=actor, run_id=run.pk, to_status="failed")
        environment_lease_release(actor=worker, lease_id=lease.pk, outcome="failed")
        recovery_action_upsert_source_scoped(
            company_id=company.pk,
            source_issue_id=issue.pk,
            data=RecoveryActionInput(
                kind=IssueRecoveryAction.Kind.WORKSPACE_VALIDATION,
                cause="sandbox_run_failed",
                fingerprint=f"run:{run.pk}",
                evidence={
                    "runId": str(run.pk),
                    "historicalWorkspaceSource": {
                        "schema": HISTORICAL_SOURCE_SCHEMA,
                        "runId": str(run.pk),
                        "leaseIds": [str(lease.pk)],
                    },
                },
                next_action="Inspect the recorded workspace source, then recover from it.",
                owner_type=IssueRecoveryAction.OwnerType.BOARD,
            ),
            actor_id="seed_demo",
        )
        self.stdout.write(
            f"Created native run {run.pk} for {SOURCE_TITLE!r}: failed, its retained sandbox"
            f" {SOURCE_ALLOCATION} recorded as the recovery action's workspace source"
        )

    def _export_marker(self, lease: EnvironmentLease, *, valid: bool) -> None:
        """What the finalizer writes on a lease with unexported work: a stop-only export-resume
        marker (simulated; `valid=False` pins another plugin, so it does not bind)."""
        result_id = (
            NativeRunResult.objects.filter(run_id=lease.heartbeat_run_id)
            .order_by("created_at")
            .values_list("pk", flat=True)
            .first()
        )
        marker = {
            "schema": "paperclip.workspace-export-resume.v2",
            "requestId": str(uuid.uuid4()),
            "purpose": "terminal_export",
            "companyId": str(lease.company_id),
            "runId": str(lease.heartbeat_run_id),
            "resultId": str(result_id or uuid.uuid4()),
            "leaseId": str(lease.pk),
            "provider": lease.provider,
            "providerLeaseId": lease.provider_lease_id,
            "pluginId": SANDBOX_PLUGIN if valid else "plugin-somebody-else",
        }
        with transaction.atomic():
            row_update_audited(
                lease,
                {"metadata": {**(lease.metadata or {}), "nativeWorkspaceExportResume": marker}},
                company_id=lease.company_id,
                actor_type="system",
                actor_id="seed_demo",
                action="environment_lease.export_resume_marked",
                entity_type="environment_lease",
                entity_id=lease.pk,
                run_id=lease.heartbeat_run_id,
                details={"requestId": marker["requestId"], "simulated": "a pending export"},
            )
        lease.refresh_from_db()

    def _claim_ran_out(self, lease_id: Any) -> None:
        """Age a claim past its 15 minutes (simulated: the provider worker that claimed it
        crashed); the next claim may take it over."""
        with transaction.atomic():
            lease = EnvironmentLease.objects.get(pk=lease_id)
            expired = int(db_now().timestamp() * 1000) - 60_000
            row_update_audited(
                lease,
                {"metadata": {**(lease.metadata or {}), "pendingCleanupLeaseExpiresAtMs": expired}},
                company_id=lease.company_id,
                actor_type="system",
                actor_id="seed_demo",
                action="environment_lease.cleanup_claim_aged",
                entity_type="environment_lease",
                entity_id=lease_id,
                run_id=lease.heartbeat_run_id,
                details={"expiresAtMs": expired, "simulated": "a provider that never answered"},
            )

    def _left_for_the_board(self, lease_id: Any) -> None:
        """Clear a failed cleanup's back-off (simulated: the provider's failure set none, as the
        export-resume preserve step does), so the worker's retry sweep never reopens it: the
        cleanup stays failed, on the dashboard, until the board's "Retry cleanup now"
        (docs/environment.md#cleanup-retries). Only the board ends this state, so the demo
        shows it with the worker's periodic tasks on their normal schedule."""
        with transaction.atomic():
            lease = EnvironmentLease.objects.get(pk=lease_id)
            row_update_audited(
                lease,
                {"metadata": {**(lease.metadata or {}), "pendingCleanupRetryAfterMs": 0}},
                company_id=lease.company_id,
                actor_type="system",
                actor_id="seed_demo",
                action="environment_lease.cleanup_left_for_the_board",
                entity_type="environment_lease",
                entity_id=lease_id,
                run_id=lease.heartbeat_run_id,
                details={
                    "retryAfterMs": 0,
                    "simulated": "a provider failure that set no back-off",
                },
            )

    def _reset(self) -> None:
        """Delete every demo company with everything in it (its rows cascade), the jobs still
        waiting for them, and the demo's files; the seed that follows builds it all again."""
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
        shutil.rmtree(self.demo_dir, ignore_errors=True)
        self.stdout.write(f"Reset: deleted {len(companies)} demo company(ies) and {self.demo_dir}")

    def _fresh_key(self, agent: Agent, user_id: Any) -> str:
        stale = AgentApiKey.objects.filter(agent=agent, name=KEY_NAME, revoked_at__isnull=True)
        for key_id in stale.order_by("pk").values_list("pk", flat=True):
            agent_key_revoke(key_id=key_id, actor_type="user", actor_id=str(user_id))
        return agent_key_create(
            agent_id=agent.pk, actor_type="user", actor_id=str(user_id), name=KEY_NAME
        ).secret


def demo_dir() -> Path:
    """Where the demo keeps its files: `demo/` in the data directory (PAPERCLIP_DATA_DIR)."""
    return Path(settings.DATA_DIR) / "demo"


class _Summary:
    """The closing lines (logins, keys, commands): printed, and kept for `save`."""

    def __init__(self, stdout: OutputWrapper) -> None:
        self.stdout = stdout
        self.lines: list[str] = []

    def write(self, line: str) -> None:
        self.stdout.write(line)
        self.lines.append(line)

    def save(self, path: Path) -> None:
        """Write the lines to `path`, readable by its owner only: it holds secrets."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600, exist_ok=True)
        path.chmod(0o600)
        path.write_text("\n".join(self.lines) + "\n")
