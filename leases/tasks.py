"""The leases app's worker tasks: the periodic stale runtime-lease sweep and the orphaned-run
sweep (docs/worker.md#tasks)."""

from __future__ import annotations

from django.conf import settings

from leases.orphans import orphaned_runs_interrupt
from leases.services import runtime_lease_sweep
from paperclip.worker.schedule import maintenance_task


@maintenance_task("sweep_runtime_leases", every="PAPERCLIP_LEASE_SWEEP_INTERVAL_SECONDS")
def sweep_runtime_leases(timestamp: int) -> str:
    """`manage.py sweep_runtime_leases`, every PAPERCLIP_LEASE_SWEEP_INTERVAL_SECONDS."""
    report = runtime_lease_sweep()
    return (
        f"deleted {report.deleted}, survived {report.survived}, "
        f"skipped (locked) {report.skipped_locked}, expiry floors raised {report.floors_raised}"
    )


@maintenance_task("interrupt_orphaned_runs", every="PAPERCLIP_LEASE_SWEEP_INTERVAL_SECONDS")
def interrupt_orphaned_runs(timestamp: int) -> str:
    """Interrupt runs orphaned for longer than PAPERCLIP_ORPHANED_RUN_GRACE_SECONDS
    (docs/leases.md#orphaned-runs)."""
    sweep = orphaned_runs_interrupt(grace_seconds=settings.PAPERCLIP_ORPHANED_RUN_GRACE_SECONDS)
    failed = f", failed {', '.join(sweep.failed)}" if sweep.failed else ""
    return (
        f"orphaned past the grace {sweep.examined}: interrupted {sweep.interrupted}, "
        f"revived {sweep.revived}{failed}"
    )
