"""The demo stays put (docs/setup.md#the-demo) with the worker's periodic tasks on their normal
schedule: every seeded state is one that only the board (or an agent or provider acting) ends,
so a pass of every periodic task leaves them all as seeded, except the stale runtime lease,
which the sweep removes by design; the dashboard still shows each kind of stuck work the
README's screenshot shows; `seed_demo --reset` brings every state back, and the logins are
saved under the data directory with the demo's files."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command

from checkpoints.tasks import expire_runner_authorities
from leases.environment.tasks import retry_environment_cleanups
from leases.models import EnvironmentLease, WorkspaceRuntimeLease
from leases.selectors import with_stale_reason
from leases.tasks import interrupt_orphaned_runs, sweep_runtime_leases
from paperclip.models import ExecutionWorkspace, HeartbeatRun
from paperclip.tasks import cas_collect_blobs
from recovery.console.attention import attention_summary
from recovery.tasks import reconcile_finalizations, reconcile_workspace_heads
from tests.helpers import run_jobs

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def data_dir(settings: Any, tmp_path: Path) -> Path:
    settings.DATA_DIR = tmp_path
    settings.PAPERCLIP_COPYBACK_ROOTS = [str(tmp_path / "demo")]  # as make run sets it
    return tmp_path


def _seed(*args: str) -> list[str]:
    out = io.StringIO()
    call_command("seed_demo", *args, stdout=out)
    return out.getvalue().splitlines()


def _states() -> dict[str, Any]:
    """What the console shows of the seeded states a periodic task could change."""
    return {
        "environment_leases": sorted(
            (lease_id, status, cleanup or "")
            for lease_id, status, cleanup in EnvironmentLease.objects.values_list(
                "provider_lease_id", "status", "cleanup_status"
            )
        ),
        "runs": sorted(
            (str(run.issue_id or run.native_issue_id), run.status, run.native_phase or "")
            for run in HeartbeatRun.objects.all()
        ),
        "stale_leases": sorted(
            (str(lease.pk), lease.stale_reason)  # type: ignore[attr-defined]
            for lease in with_stale_reason(WorkspaceRuntimeLease.objects.all())
        ),
    }


def _every_periodic_task() -> None:
    """One pass of each periodic task that reads or writes the demo's rows (the worker's
    own upkeep, recover_stalled_jobs and remove_old_jobs, reads only jobs)."""
    retry_environment_cleanups(timestamp=0)
    sweep_runtime_leases(timestamp=0)
    interrupt_orphaned_runs(timestamp=0)
    expire_runner_authorities(timestamp=0)
    reconcile_finalizations(timestamp=0)
    reconcile_workspace_heads(timestamp=0)
    cas_collect_blobs(timestamp=0)


def test_a_pass_of_every_periodic_task_leaves_every_seeded_state_but_the_stale_lease() -> None:
    _seed()
    seeded = _states()
    assert ("sbx-demo-failed", "pending_cleanup", "failed") in seeded["environment_leases"]
    assert [reason for _, reason in seeded["stale_leases"]] == ["owner_issue_terminal"]

    _every_periodic_task()

    after = _states()
    assert after["stale_leases"] == []  # the sweep's job, at its first pass
    assert {**after, "stale_leases": seeded["stale_leases"]} == seeded
    # The failed cleanup set no back-off: no later pass reopens it, only the board does.
    failed = EnvironmentLease.objects.get(provider_lease_id="sbx-demo-failed")
    assert failed.metadata["pendingCleanupRetryAfterMs"] == 0
    _every_periodic_task()
    assert _states() == after


@pytest.mark.django_db(transaction=True)
def test_the_dashboard_shows_the_readmes_kinds_of_stuck_work_after_the_periodic_tasks() -> None:
    """The README's screenshot shows a finalization held for the board and a blocked cleanup;
    both stay on the dashboard once the worker has run its jobs and periodic tasks, with the
    failed cleanup and the overdue cleanup claim."""
    _seed()
    _every_periodic_task()
    run_jobs()  # the held run's finalization meets its dead owner's receipt: held
    _every_periodic_task()
    counts = {
        tile.kind: tile.count
        for tile in attention_summary(company_ids=None, include_jobs=False).tiles
    }
    assert counts["finalization_held"] >= 1
    assert counts["cleanup_marker_invalid"] == 1
    assert counts["cleanup_failed"] == 1
    assert counts["cleanup_claim_overdue"] == 1
    assert counts["runtime_lease_stale"] == 0


def test_reset_brings_every_seeded_state_back(data_dir: Path) -> None:
    _seed()
    seeded = _states()
    sweep_runtime_leases(timestamp=0)
    EnvironmentLease.objects.filter(provider_lease_id="sbx-demo-failed").update(
        cleanup_status=EnvironmentLease.CleanupStatus.PENDING
    )
    assert _states() != seeded

    lines = _seed("--reset")

    def shape(states: dict[str, Any]) -> dict[str, Any]:
        # Ids are new after a reset; what each state is must be the same.
        return {
            "environment_leases": states["environment_leases"],
            "runs": sorted((status, phase) for _, status, phase in states["runs"]),
            "stale_leases": [reason for _, reason in states["stale_leases"]],
        }

    assert shape(_states()) == shape(seeded)
    demo = data_dir / "demo"
    assert all(
        Path(cwd).is_relative_to(demo)
        for cwd in ExecutionWorkspace.objects.values_list("cwd", flat=True)
    )
    logins = demo / "logins.txt"
    assert f"(saved to {logins}: the logins stay there when the log scrolls)" in lines
    saved = logins.read_text().splitlines()
    assert [line for line in lines if " key: pcak_" in line] == [
        line for line in saved if " key: pcak_" in line
    ]
    assert any(line.startswith("Admin login:") for line in saved)
    assert logins.stat().st_mode & 0o777 == 0o600
