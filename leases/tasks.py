"""The leases app's worker task: the periodic stale runtime-lease sweep (docs/worker.md#tasks)."""

from __future__ import annotations

from django.conf import settings
from procrastinate.contrib.django import app

from leases.services import runtime_lease_sweep
from paperclip.worker.schedule import cron_every


@app.periodic(
    cron=cron_every(
        settings.PAPERCLIP_LEASE_SWEEP_INTERVAL_SECONDS,
        setting="PAPERCLIP_LEASE_SWEEP_INTERVAL_SECONDS",
    ),
    periodic_id="sweep_runtime_leases",
)
@app.task(name="sweep_runtime_leases", queue="maintenance", queueing_lock="sweep_runtime_leases")
def sweep_runtime_leases(timestamp: int) -> str:
    """`manage.py sweep_runtime_leases`, every PAPERCLIP_LEASE_SWEEP_INTERVAL_SECONDS."""
    report = runtime_lease_sweep()
    return (
        f"deleted {report.deleted}, survived {report.survived}, "
        f"skipped (locked) {report.skipped_locked}"
    )
