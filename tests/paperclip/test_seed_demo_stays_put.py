"""The demo stays put (docs/setup.md#the-demo): one pass of every periodic task that could touch
a seeded state leaves them all as seeded, the one the sweep removes by design waits for the
worker's periodic delay, `seed_demo --reset` brings every state back, and the logins are saved
under the data directory with the demo's files."""

from __future__ import annotations

import asyncio
import io
import time
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from procrastinate import worker as procrastinate_worker

from checkpoints.tasks import expire_runner_authorities
from leases.environment.tasks import retry_environment_cleanups
from leases.models import EnvironmentLease, WorkspaceRuntimeLease
from leases.selectors import with_stale_reason
from leases.tasks import interrupt_orphaned_runs, sweep_runtime_leases
from paperclip.db.clock import db_now
from paperclip.models import ExecutionWorkspace, HeartbeatRun
from paperclip.tasks import cas_collect_blobs
from paperclip.worker.process import ResilientWorker
from recovery.tasks import reconcile_finalizations, reconcile_workspace_heads

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


def test_seeded_states_survive_a_pass_of_each_periodic_task() -> None:
    _seed()
    seeded = _states()
    assert ("sbx-demo-failed", "pending_cleanup", "failed") in seeded["environment_leases"]
    assert [reason for _, reason in seeded["stale_leases"]] == ["owner_issue_terminal"]

    retry_environment_cleanups(timestamp=0)
    interrupt_orphaned_runs(timestamp=0)
    expire_runner_authorities(timestamp=0)
    reconcile_finalizations(timestamp=0)
    reconcile_workspace_heads(timestamp=0)
    cas_collect_blobs(timestamp=0)

    assert _states() == seeded
    # The failed cleanup's retry is due only after the demo has been looked at.
    failed = EnvironmentLease.objects.get(provider_lease_id="sbx-demo-failed")
    retry_after_ms = failed.metadata["pendingCleanupRetryAfterMs"]
    assert retry_after_ms >= (db_now().timestamp() + 10 * 60) * 1000


def test_the_stale_lease_waits_for_the_workers_periodic_delay(settings: Any) -> None:
    """A lease stale because its issue closed is swept at the sweep's next pass by design, so
    under `make run` the worker defers its periodic tasks late instead."""
    _seed()
    sweep_runtime_leases(timestamp=0)
    assert not WorkspaceRuntimeLease.objects.exists()

    settings.PAPERCLIP_WORKER_PERIODIC_DELAY_SECONDS = 0.3
    started: list[float] = []

    async def deferrer(self: Any) -> None:
        started.append(time.monotonic())

    worker = ResilientWorker.__new__(ResilientWorker)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(procrastinate_worker.Worker, "_periodic_deferrer", deferrer)
        begin = time.monotonic()
        asyncio.run(worker._periodic_deferrer())
    assert len(started) == 1
    assert started[0] - begin >= 0.3


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
