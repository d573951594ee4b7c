"""Factories and builders for recovery tests."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import factory

from paperclip.models import (
    Agent,
    Company,
    ExecutionWorkspace,
    HeartbeatRun,
    Issue,
    NativeRunFinalization,
    NativeRunResult,
)
from paperclip.receipts import OWNER_KEY
from recovery.adapters.identity import current_controller_identity, process_started_at
from recovery.models import IssueRecoveryAction
from tests.paperclip.factories import (
    AgentFactory,
    CompanyFactory,
    ExecutionWorkspaceFactory,
    IssueFactory,
    NativeRunFactory,
    NativeRunFinalizationFactory,
    NativeRunResultFactory,
)


class RecoveryActionFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = IssueRecoveryAction

    source_issue = factory.SubFactory(IssueFactory)
    company = factory.SelfAttribute("source_issue.company")
    kind = IssueRecoveryAction.Kind.STRANDED_ASSIGNED_ISSUE
    cause = "stranded"
    fingerprint = factory.Sequence(lambda n: f"fp-{n}")
    next_action = "do something"

    class Params:
        # A board-owned export-failure action: what a native workspace recovery source hangs off.
        workspace_source = factory.Trait(
            kind=IssueRecoveryAction.Kind.WORKSPACE_VALIDATION,
            owner_type=IssueRecoveryAction.OwnerType.BOARD,
            cause="native_workspace_sync_out_retry_exhausted",
            next_action="Inspect the recorded workspace source.",
        )


@dataclass
class Binding:
    company: Company
    agent: Agent
    issue: Issue
    run: HeartbeatRun
    coordinator: NativeRunFinalization
    result: NativeRunResult | None
    workspace: ExecutionWorkspace
    source_dir: Path | None
    dest_dir: Path | None

    def refresh(self) -> None:
        for obj in (self.issue, self.run, self.coordinator, self.workspace):
            obj.refresh_from_db()


def make_binding(
    *,
    company: Company | None = None,
    tmp_path: Path | None = None,
    phase: str = NativeRunFinalization.Phase.RESULT_ACCEPTED,
    with_result: bool = True,
    receipt: Any = None,
) -> Binding:
    """A running native run holding its issue, with an accepted result waiting for
    finalization, a workspace directory with files and an execution workspace cwd."""
    company = company or CompanyFactory()
    agent = AgentFactory(company=company)
    source_dir = dest_dir = None
    if tmp_path is not None:
        source_dir = tmp_path / "runner-workspace"
        (source_dir / "src").mkdir(parents=True)
        (source_dir / "README.md").write_text("hello\n")
        (source_dir / "src" / "main.py").write_text("print('hi')\n")
        dest_dir = tmp_path / "host" / "repo"
    workspace = ExecutionWorkspaceFactory(company=company, cwd=str(dest_dir) if dest_dir else None)
    issue = IssueFactory(company=company, assignee_agent=agent, execution_workspace=workspace)
    profile: dict[str, Any] = {}
    if source_dir is not None:
        profile["nativeExecutionInput"] = {"binding": {"workspaceDir": str(source_dir)}}
    if receipt is not None:
        profile[OWNER_KEY] = receipt
    run = NativeRunFactory(
        company=company,
        agent=agent,
        issue=issue,
        native_issue=issue,
        execution_workspace=workspace,
        runner_profile_json=profile,
        status=HeartbeatRun.Status.RUNNING,
    )
    issue.execution_run = run
    issue.checkout_run = run
    issue.save(update_fields=["execution_run", "checkout_run"])
    result = None
    if with_result:
        result = NativeRunResultFactory(run=run)
    coordinator = NativeRunFinalizationFactory(run=run, phase=phase, result=result)
    return Binding(company, agent, issue, run, coordinator, result, workspace, source_dir, dest_dir)


def exited_pid() -> int:
    """The pid of a process of this host that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=10)
    return proc.pid


def receipt_for(
    *,
    hostname: str | None = None,
    pid: int | None = None,
    started: datetime | None = None,
    start_ticks: int | None = None,
    boot_id: str | None = None,
    kernel_boot_id: str | None = None,
    legacy: bool = False,
    worker: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A receipt as ownership writes it: by default this process's host, boot, pid and start
    (a wall-clock time and ticks since boot). `started` or `start_ticks` record another start:
    with `started` alone the receipt has no ticks and is judged by the wall-clock time, as one
    written before ticks were recorded. `legacy` leaves out the kernel boot id and the ticks,
    as receipts written before either did."""
    me = current_controller_identity()
    # Read afresh, not the identity's: a clock step since it was read would move it.
    wall = started or process_started_at(os.getpid()) or me.process_started_at
    value: dict[str, Any] = {
        "token": str(uuid.uuid4()),
        "controllerBootId": boot_id or str(uuid.uuid4()),
        "hostname": hostname or me.hostname,
        "pid": pid or os.getpid(),
        "processStartedAt": wall.astimezone(UTC).isoformat(),
    }
    kernel_boot = kernel_boot_id or me.kernel_boot_id
    if not legacy and kernel_boot is not None:
        value["kernelBootId"] = kernel_boot
    ticks = me.process_start_ticks if started is None and start_ticks is None else start_ticks
    if not legacy and ticks is not None:
        value["processStartTicks"] = ticks
    if worker is not None:
        value["worker"] = worker
    return value


def hold_for_board(b: Binding, receipt: dict[str, Any]) -> IssueRecoveryAction:
    """The owner-unverified hold the finalization controller records for `b`'s run whose
    recorded owner is `receipt` (as recovery/services/ownership/owner_hold.py writes it)."""
    from recovery.selectors.actions import OWNER_UNVERIFIED_CAUSE
    from recovery.services.ownership.owner_hold import (
        OWNER_UNVERIFIED_NEXT_ACTION,
        owner_fingerprint,
    )

    return IssueRecoveryAction.objects.create(
        company=b.company,
        source_issue=b.issue,
        kind="active_run_watchdog",
        owner_type="board",
        return_owner_agent=b.agent,
        cause=OWNER_UNVERIFIED_CAUSE,
        fingerprint=owner_fingerprint(b.run.pk, receipt),
        evidence={
            "runId": str(b.run.pk),
            "owner": receipt,
            "workspaceOwnerRecovery": {"state": "operator_required"},
        },
        next_action=OWNER_UNVERIFIED_NEXT_ACTION,
        attempt_count=1,
        max_attempts=1,
        held_run=b.run,
    )


def next_run(b: Binding, *, receipt: Any = None) -> Binding:
    """A later run of `b`'s agent on the same issue and workspace, started (it holds the
    issue's slots now) and with an accepted result waiting for finalization."""
    profile: dict[str, Any] = {} if receipt is None else {OWNER_KEY: receipt}
    run = NativeRunFactory(
        company=b.company,
        agent=b.agent,
        issue=b.issue,
        native_issue=b.issue,
        execution_workspace=b.workspace,
        runner_profile_json=profile,
        status=HeartbeatRun.Status.RUNNING,
    )
    Issue.objects.filter(pk=b.issue.pk).update(execution_run=run, checkout_run=run)
    result = NativeRunResultFactory(run=run)
    coordinator = NativeRunFinalizationFactory(
        run=run, phase=NativeRunFinalization.Phase.RESULT_ACCEPTED, result=result
    )
    b.issue.refresh_from_db()
    return Binding(b.company, b.agent, b.issue, run, coordinator, result, b.workspace, None, None)
