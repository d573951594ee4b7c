"""Finalization under ownership: the reconciler (progress, busy owners skip without spending a
retry, retry time rechecked under ownership), fences after ownership moved on, abandoned
`running` barrier rows, and the finalize endpoint when ownership is lost mid-way."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from io import StringIO
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
from django.core.management import call_command
from django.test import override_settings
from django.utils import timezone

from paperclip.models import ActivityEvent, HeartbeatRun, NativeRunFinalization, WorkspaceOperation
from paperclip.receipts import OWNER_KEY
from recovery.adapters.copyback import CopybackReport
from recovery.errors import FinalizationOwnershipLost
from recovery.locks import finalization_lock_key
from recovery.services import Acquired, run_finalize
from tests.helpers import raw_connection, run_jobs
from tests.recovery.factories import Binding, make_binding

pytestmark = pytest.mark.django_db(transaction=True)

BACKENDS = "tests.recovery.services.test_finalization"


class TerminatingCopyback:
    """Copy-back during which the server ends the finalization lock session."""

    def copy_back(
        self, *, run_id: UUID, source: str, destination: str, check: Callable[[], None]
    ) -> CopybackReport:
        with raw_connection() as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = 'paperclip-finalization-lock' "
                "AND datname = current_database()"
            )
        check()
        raise AssertionError("check() must notice the lost lock")


class ReceiptReplacingCopyback:
    """Copy-back that fails after its receipt was replaced (a board release and a new owner
    while this controller was stuck in I/O)."""

    def copy_back(
        self, *, run_id: UUID, source: str, destination: str, check: Callable[[], None]
    ) -> CopybackReport:
        newer = {"token": str(uuid.uuid4()), "hostname": "other", "pid": 1}
        HeartbeatRun.objects.filter(pk=run_id).update(runner_profile_json={OWNER_KEY: newer})
        raise OSError("disk went away")


def _coordinator(b: Binding) -> NativeRunFinalization:
    return NativeRunFinalization.objects.get(pk=b.run.pk)


def test_reconcile_skips_a_busy_owner_without_spending_a_retry_and_reports_progress(
    tmp_path: Path,
) -> None:
    busy = make_binding()
    ready = make_binding(tmp_path=tmp_path)
    out = StringIO()
    with raw_connection() as other:
        other.execute(
            "SELECT pg_advisory_lock(hashtextextended(%s, 0))",
            [finalization_lock_key(busy.company.pk, busy.run.pk)],
        )
        call_command("reconcile_finalizations", "--batch-size", "1", stdout=out)
        run_jobs()
        # Released here, not by the connection's close: that ends on the server a moment later.
        other.execute("SELECT pg_advisory_unlock_all()")
    text = out.getvalue()
    assert f"  run {busy.run.pk}: skipped (busy: an owner is finalizing it)" in text
    assert re.search(rf"^  run {ready.run.pk}: deferred job \d+$", text, re.M)
    assert re.search(r"^batch 1: 1 run\(s\)$", text, re.M)
    assert re.search(r"^batch 2: 1 run\(s\)$", text, re.M)
    assert "examined 2: deferred 1, already queued 0, skipped busy 1, skipped held 0" in text
    held = _coordinator(busy)
    assert (held.phase, held.attempt, held.next_attempt_at, held.failure_code) == (
        "result_accepted",
        0,
        None,
        None,
    )
    assert not WorkspaceOperation.objects.filter(heartbeat_run_id=busy.run.pk).exists()
    assert _coordinator(ready).phase == "committed"
    # Still waiting: the next sweep defers it once the owner lets go, and a repeat defers
    # nothing more (one waiting job per run).
    out = StringIO()
    call_command("reconcile_finalizations", stdout=out)
    call_command("reconcile_finalizations", stdout=out)
    assert "examined 1: deferred 1, already queued 0" in out.getvalue()
    assert "examined 1: deferred 0, already queued 1" in out.getvalue()
    run_jobs()
    assert _coordinator(busy).phase == "committed"


def test_retry_time_is_rechecked_under_ownership(tmp_path: Path) -> None:
    b = make_binding(tmp_path=tmp_path, phase="workspace_finalizing")
    later = timezone.now() + timezone.timedelta(hours=1)
    NativeRunFinalization.objects.filter(pk=b.run.pk).update(next_attempt_at=later, attempt=1)

    # Selected by a sweep before another reconciler scheduled the retry: spend nothing.
    outcome = run_finalize(company_id=b.company.pk, run_id=b.run.pk, due_only=True)

    assert isinstance(outcome, Acquired)
    assert outcome.value.status == "not_due"
    assert _coordinator(b).attempt == 1
    assert not WorkspaceOperation.objects.filter(heartbeat_run_id=b.run.pk).exists()
    # An explicit finalize (operator, agent) does not wait for the retry time.
    explicit = run_finalize(company_id=b.company.pk, run_id=b.run.pk)
    assert isinstance(explicit, Acquired)
    assert explicit.value.status == "committed"


def test_a_running_barrier_row_of_a_previous_owner_is_closed_as_abandoned(tmp_path: Path) -> None:
    b = make_binding(tmp_path=tmp_path, phase="workspace_finalizing")
    stale = WorkspaceOperation.objects.create(
        company=b.company,
        heartbeat_run=b.run,
        issue=b.issue,
        phase="workspace_finalize",
        status="running",
        metadata={"ownerToken": "previous"},
    )
    outcome = run_finalize(company_id=b.company.pk, run_id=b.run.pk)
    assert isinstance(outcome, Acquired)
    assert outcome.value.status == "committed"
    stale.refresh_from_db()
    assert stale.status == "failed"
    assert stale.finished_at is not None
    assert stale.metadata == {"ownerToken": "previous", "error": "abandoned_by_previous_owner"}
    assert not WorkspaceOperation.objects.filter(heartbeat_run=b.run, status="running").exists()
    audit = ActivityEvent.objects.get(action="run.workspace_finalize_abandoned")
    assert audit.details == {"operationIds": [str(stale.pk)]}


@override_settings(PAPERCLIP_COPYBACK_BACKEND=f"{BACKENDS}.ReceiptReplacingCopyback")
def test_a_copyback_failure_after_ownership_moved_on_publishes_no_retry(tmp_path: Path) -> None:
    b = make_binding(tmp_path=tmp_path)
    with pytest.raises(FinalizationOwnershipLost):
        run_finalize(company_id=b.company.pk, run_id=b.run.pk)
    coordinator = _coordinator(b)
    assert (coordinator.next_attempt_at, coordinator.failure_code) == (None, None)
    assert not ActivityEvent.objects.filter(
        action__startswith="run.workspace_finalize_retry"
    ).exists()


@override_settings(PAPERCLIP_COPYBACK_BACKEND=f"{BACKENDS}.TerminatingCopyback")
def test_a_finalization_job_that_loses_ownership_mid_copy_publishes_nothing(
    tmp_path: Path, make_agent_client: Any
) -> None:
    b = make_binding(tmp_path=tmp_path)
    res = make_agent_client(b.agent).post(f"/api/heartbeat-runs/{b.run.pk}/finalize")
    assert res.status_code == 202
    run_jobs()
    b.refresh()
    assert (b.coordinator.phase, b.run.status) == ("workspace_finalizing", "running")
    op = WorkspaceOperation.objects.get(heartbeat_run=b.run)
    assert (op.status, op.metadata["error"]) == ("failed", "ownership_lost")
    assert OWNER_KEY not in b.run.runner_profile_json  # it removed only its own receipt
    assert b.dest_dir is not None
    assert not b.dest_dir.exists()
