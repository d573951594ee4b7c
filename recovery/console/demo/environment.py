"""The demo's sandbox environment and its leases, one in each state of `ENVIRONMENT_LEASES`,
made by the provider agent through the lifecycle and cleanup services; the states no service
reaches on its own (a pending export, a claim that ran out, a failure left for the board) are
simulated by an audited row update. Also the failed run whose retained sandbox a recovery
action records as its workspace source."""

from __future__ import annotations

import uuid
from typing import Any

from django.core.management.base import OutputWrapper
from django.db import transaction

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
from paperclip import services
from paperclip.access import Actor, agent_actor
from paperclip.activity import row_update_audited
from paperclip.db.clock import db_now
from paperclip.models import (
    Agent,
    Company,
    Environment,
    ExecutionWorkspace,
    HeartbeatRun,
    Issue,
    NativeRunResult,
)
from recovery.console.demo.plan import (
    AGENTS,
    ENVIRONMENT,
    ENVIRONMENT_LEASES,
    SANDBOX_PLUGIN,
    SANDBOX_PROVIDER,
    SOURCE_ALLOCATION,
    SOURCE_TITLE,
    LeaseSpec,
)
from recovery.models import IssueRecoveryAction
from recovery.selectors.source.inspection import HISTORICAL_SOURCE_SCHEMA
from recovery.services.actions import RecoveryActionInput, recovery_action_upsert_source_scoped


def demo_environment_leases(
    out: OutputWrapper,
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
        out.write(f"Created environment {ENVIRONMENT} ({environment.pk})")
    worker = agent_actor(provider)
    recovery_source(out, actor, worker, company, environment)
    for spec in ENVIRONMENT_LEASES:
        _lease_in_state(out, worker, company, environment, workspaces, spec)


def _lease_in_state(
    out: OutputWrapper,
    worker: Actor,
    company: Company,
    environment: Environment,
    workspaces: list[ExecutionWorkspace],
    spec: LeaseSpec,
) -> None:
    """One lease of `ENVIRONMENT_LEASES`, unless it exists (or its run does not yet)."""
    allocation, title, policy, ws, outcome, steps, marker = spec
    if EnvironmentLease.objects.filter(company=company, provider_lease_id=allocation).exists():
        return
    run = (
        HeartbeatRun.objects.filter(company=company, issue__title=title)
        .order_by("created_at", "pk")
        .first()
    )
    if run is None:
        return
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
        export_marker(lease, valid=marker == "valid")
    if outcome is not None:
        lease = environment_lease_release(
            actor=worker,
            lease_id=lease.pk,
            outcome=outcome,  # type: ignore[arg-type]
        ).lease
    _cleanup_steps(worker, company, lease, allocation, steps)
    lease.refresh_from_db()
    out.write(
        f"Environment lease {allocation} ({lease.pk}) for {title!r}: {lease.status}"
        f" (cleanup {lease.cleanup_status or '-'})"
    )


def _cleanup_steps(
    worker: Actor,
    company: Company,
    lease: EnvironmentLease,
    allocation: str,
    steps: tuple[str, ...],
) -> None:
    """After the release: claim the cleanup, age the claim, leave a failure for the board, or
    settle it in the named state."""
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
            claim_ran_out(lease.pk)
        elif step == "for_the_board":
            left_for_the_board(lease.pk)
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


def recovery_source(
    out: OutputWrapper, actor: Actor, worker: Actor, company: Company, environment: Environment
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
    out.write(
        f"Created native run {run.pk} for {SOURCE_TITLE!r}: failed, its retained sandbox"
        f" {SOURCE_ALLOCATION} recorded as the recovery action's workspace source"
    )


def export_marker(lease: EnvironmentLease, *, valid: bool) -> None:
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


def claim_ran_out(lease_id: Any) -> None:
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


def left_for_the_board(lease_id: Any) -> None:
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
