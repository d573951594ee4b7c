"""The hold's verdict advises what really moves the run: an owner of this host that is gone
and left its copy-back barrier could be taken over by an attempt, but while the hold is live
`finalize` is refused as held and the reconciler skips the run, so the verdict tells the
board to confirm, and that confirmation finalizes it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from paperclip.access import board_actor
from paperclip.models import BoardMembership, NativeRunFinalization, WorkspaceOperation
from recovery.adapters.identity import process_start_ticks, process_started_at
from recovery.models import IssueRecoveryAction
from recovery.selectors.actions import OWNER_UNVERIFIED_CAUSE
from recovery.selectors.verdict import owner_hold_verdict
from recovery.services import (
    NotAcquired,
    finalizations_reconcile,
    recovery_owner_stop_confirm,
    run_finalize,
)
from tests.helpers import run_jobs
from tests.paperclip.factories import UserFactory
from tests.recovery.factories import make_binding, receipt_for

pytestmark = pytest.mark.django_db(transaction=True)

EVIDENCE = "controller pid gone on this host, copy-back barrier recorded, nothing left running"


def test_a_gone_owner_with_its_barrier_is_confirmed_by_the_board_as_the_verdict_says(
    tmp_path: Path, make_agent_client: Any
) -> None:
    # The owner: a process of this host that copied back (barrier recorded), then hung
    # without committing.
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = process_started_at(owner.pid)
        assert started is not None
        receipt = receipt_for(
            pid=owner.pid, started=started, start_ticks=process_start_ticks(owner.pid)
        )
        b = make_binding(tmp_path=tmp_path, receipt=receipt, phase="workspace_finalizing")
        WorkspaceOperation.objects.create(
            company=b.company,
            heartbeat_run=b.run,
            issue=b.issue,
            execution_workspace=b.workspace,
            phase=WorkspaceOperation.PHASE_WORKSPACE_FINALIZE,
            status=WorkspaceOperation.Status.SUCCEEDED,
        )
        assert run_finalize(company_id=b.company.pk, run_id=b.run.pk) == NotAcquired(
            "owner_unverified"
        )
    finally:
        owner.kill()  # the operator stops the hung owner
        owner.wait(timeout=10)
    (hold,) = IssueRecoveryAction.objects.filter(cause=OWNER_UNVERIFIED_CAUSE, held_run=b.run)

    verdict = owner_hold_verdict(hold)

    assert verdict.kind == "same_host_dead_with_barrier"
    assert verdict.confirmable
    assert not any("finalize now" in check.lower() for check in verdict.checks)
    assert any(check.startswith("Confirm the owner stopped") for check in verdict.checks)
    # As the verdict says: nothing else moves the run ...
    response = make_agent_client(b.agent).post(f"/api/heartbeat-runs/{b.run.pk}/finalize")
    assert response.status_code == 409
    assert finalizations_reconcile().skipped_held == 1
    # ... and the board's confirmation does.
    user = UserFactory()
    BoardMembership.objects.create(user=user, company=b.company)
    recovery_owner_stop_confirm(
        actor=board_actor(user),
        issue_id=b.issue.pk,
        action_id=hold.pk,
        run_id=b.run.pk,
        owner_token=receipt["token"],
        stop_evidence=EVIDENCE,
        controller_and_copyback_stopped=True,
    )
    run_jobs()
    assert NativeRunFinalization.objects.get(pk=b.run.pk).phase == "committed"
