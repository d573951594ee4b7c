"""The checkpoints app's worker task: expiring lapsed runner authorities (docs/worker.md#tasks)."""

from __future__ import annotations

from checkpoints.services import expired_authorities_sweep
from paperclip.worker.schedule import maintenance_task


@maintenance_task("expire_runner_authorities", every="PAPERCLIP_AUTHORITY_EXPIRY_INTERVAL_SECONDS")
def expire_runner_authorities(timestamp: int) -> str:
    """`manage.py expire_runner_authorities`, every PAPERCLIP_AUTHORITY_EXPIRY_INTERVAL_SECONDS."""
    sweep = expired_authorities_sweep()
    return f"found {sweep.found}, expired {sweep.expired}, skipped {sweep.skipped}"
