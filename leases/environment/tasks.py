"""The environment app's worker task: reopening failed cleanups whose back-off is over
(docs/worker.md#tasks)."""

from __future__ import annotations

from leases.environment.services import environment_cleanups_retry_due
from paperclip.worker.schedule import maintenance_task


@maintenance_task("retry_environment_cleanups", every="PAPERCLIP_CLEANUP_RETRY_INTERVAL_SECONDS")
def retry_environment_cleanups(timestamp: int) -> str:
    """Every PAPERCLIP_CLEANUP_RETRY_INTERVAL_SECONDS: failed cleanups past their back-off
    become pending again (claims before that get `cleanup_retry_not_due`)."""
    sweep = environment_cleanups_retry_due()
    return f"examined {sweep.examined}, reopened {len(sweep.reopened)}"
