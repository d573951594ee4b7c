"""The leases app's worker task: the periodic stale runtime-lease sweep (docs/worker.md#tasks)."""

from __future__ import annotations

from leases.services import runtime_lease_sweep
from paperclip.worker.schedule import maintenance_task


@maintenance_task("sweep_runtime_leases", every="PAPERCLIP_LEASE_SWEEP_INTERVAL_SECONDS")
def sweep_runtime_leases(timestamp: int) -> str:
    """`manage.py sweep_runtime_leases`, every PAPERCLIP_LEASE_SWEEP_INTERVAL_SECONDS."""
    report = runtime_lease_sweep()
    return (
        f"deleted {report.deleted}, survived {report.survived}, "
        f"skipped (locked) {report.skipped_locked}"
    )
