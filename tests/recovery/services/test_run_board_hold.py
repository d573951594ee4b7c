"""`run_board_hold`: the hold a run's pages offer is the one its finalization waits on now.
A run held for its export, whose board retry's worker then died mid-copy, is held again over
the unverified owner: the owner-stop hold is offered, and a retry on the export hold is no
longer answered "already queued" (no job carries it) but refused by the locked checks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.test import override_settings
from procrastinate.contrib.django.models import ProcrastinateJob

from paperclip.access import board_actor
from paperclip.models import BoardMembership, HeartbeatRun, NativeRunFinalization
from paperclip.receipts import OWNER_KEY
from recovery.errors import WorkspaceExportRetryStale
from recovery.selectors.actions import OWNER_UNVERIFIED_CAUSE, run_board_hold
from recovery.selectors.finalization import finalization_state
from recovery.services import NotAcquired, run_finalize
from recovery.services.export_repair import workspace_export_retry
from tests.paperclip.factories import UserFactory
from tests.recovery.factories import receipt_for
from tests.recovery.services.test_export_repair import NOTE, _blocked, _exhaust, _repair

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("one_attempt")]


@pytest.fixture
def one_attempt() -> Iterator[None]:
    with override_settings(PAPERCLIP_FINALIZE_MAX_ATTEMPTS=1):
        yield


def test_a_run_held_again_over_its_owner_offers_the_owner_hold_not_its_export_hold(
    tmp_path: Path,
) -> None:
    b = _blocked(tmp_path)
    export_hold = _exhaust(b)
    _repair(b)
    user = UserFactory()
    BoardMembership.objects.create(user=user, company=b.company)
    args: dict[str, Any] = {
        "actor": board_actor(user),
        "issue_id": b.issue.pk,
        "action_id": export_hold.pk,
        "run_id": b.run.pk,
        "repair_note": NOTE,
    }
    assert not workspace_export_retry(**args).replayed
    assert run_board_hold(company_id=b.company.pk, run_id=b.run.pk) == export_hold
    # The retry's job claims the run on a worker that dies mid-copy: its receipt stays, the
    # coordinator is left in workspace_finalizing, the job is lost.
    ProcrastinateJob.objects.filter(status="todo").update(status="failed")
    dead = receipt_for(hostname="worker-3.gone.example")
    profile = HeartbeatRun.objects.get(pk=b.run.pk).runner_profile_json
    HeartbeatRun.objects.filter(pk=b.run.pk).update(
        runner_profile_json={**profile, OWNER_KEY: dead}
    )
    NativeRunFinalization.objects.filter(pk=b.run.pk).update(phase="workspace_finalizing")
    assert run_finalize(company_id=b.company.pk, run_id=b.run.pk) == NotAcquired("owner_unverified")
    state = finalization_state(HeartbeatRun.objects.get(pk=b.run.pk))
    assert (state.state, state.reason) == ("held", "owner_unverified")

    offered = run_board_hold(company_id=b.company.pk, run_id=b.run.pk)

    assert offered is not None
    assert offered.cause == OWNER_UNVERIFIED_CAUSE
    assert offered.evidence["owner"] == dead
    with pytest.raises(WorkspaceExportRetryStale) as stale:
        workspace_export_retry(**args)
    assert stale.value.details == {"reason": "coordinator_not_waiting"}
