"""The demo's runs: a few in ordinary states, then the stuck ones the dashboard shows (a run
held for the board after its controller died mid copy-back, a run whose export failed on every
attempt, a runtime lease that outlived its issue)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import OutputWrapper
from django.db import transaction

from leases.services import RuntimeLeaseOwner, runtime_lease_claim
from paperclip import services
from paperclip.activity import row_update_audited
from paperclip.db.clock import db_now_iso
from paperclip.host import kernel_boot_id
from paperclip.models import (
    Agent,
    ExecutionWorkspace,
    HeartbeatRun,
    Issue,
    NativeRunFinalization,
)
from paperclip.receipts import OWNER_KEY
from recovery.console.demo.plan import (
    EXPORT_BLOCKER,
    EXPORT_HELD_TITLE,
    EXPORT_HELD_WORKDIR,
    HELD_TITLE,
    HELD_WORKDIR,
    STALE_TITLE,
)
from recovery.services import result_accept
from recovery.services.export_repair import export_hold_in_tx


def demo_runs(
    out: OutputWrapper,
    root: Path,
    actor: Any,
    agents: list[Agent],
    workspaces: list[ExecutionWorkspace],
    issues: dict[str, Issue],
) -> None:
    """Four runs in ordinary states, then the held run, the held export and the stale lease
    (once: the command calls it only while the company has no run)."""
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
        out.write(f"Created {mode} run {run.pk} for {title!r} [{run.status}]")
    held_run(out, root, actor, beta, export, issues[HELD_TITLE])
    held_export(out, root, actor, alpha, archive, issues[EXPORT_HELD_TITLE])
    stale_lease(out, actor, alpha, review, issues[STALE_TITLE])


def stale_lease(
    out: OutputWrapper, actor: Any, agent: Agent, workspace: ExecutionWorkspace, issue: Issue
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
    out.write(
        f"Claimed the runtime lease of {workspace.name} for {issue.title!r}, then closed the "
        "issue: the lease is stale (owner_issue_terminal) until swept or force-released"
    )


def native_running(
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


def held_run(
    out: OutputWrapper,
    root: Path,
    actor: Any,
    agent: Agent,
    workspace: ExecutionWorkspace,
    issue: Issue,
) -> None:
    """A native run whose result is accepted while the receipt of a controller that died
    mid copy-back is still recorded: the worker will hold it for the board."""
    workdir = root / HELD_WORKDIR
    (workdir / "out").mkdir(parents=True, exist_ok=True)
    (workdir / "out" / "export.csv").write_text("id,total\n1,42\n")
    (workdir / "README.md").write_text("Nightly export produced by demo-agent-beta.\n")
    run = native_running(actor, agent, workspace, issue, workdir)
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
    out.write(
        f"Created native run {run.pk} for {issue.title!r}: result accepted, its controller "
        "gone mid copy-back; the worker holds it for the board (admin: Issue recovery actions)"
    )


def held_export(
    out: OutputWrapper,
    root: Path,
    actor: Any,
    agent: Agent,
    workspace: ExecutionWorkspace,
    issue: Issue,
) -> None:
    """A native run whose export into its workspace fails for real on every attempt (the
    cwd's parent is a regular file): the finalizer's attempts spend the retry budget and the
    board gets the hold whose button is "Retry workspace export"."""
    workdir = root / EXPORT_HELD_WORKDIR
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    (workdir / "logs" / "build-1042.log").write_text("build 1042: ok (3 m 12 s)\n")
    blocker = root / EXPORT_BLOCKER
    if not blocker.is_file():
        shutil.rmtree(blocker, ignore_errors=True)
        blocker.write_text(
            "A stand-in for a full disk: the archive workspace's cwd cannot be created under "
            "this file. Remove it, then use Retry workspace export on the held run.\n"
        )
    run = native_running(actor, agent, workspace, issue, workdir)
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
    out.write(
        f"Created native run {run.pk} for {issue.title!r}: its export failed on every "
        f"attempt; remove {blocker} and use Retry workspace export (admin: the run's page)"
    )
