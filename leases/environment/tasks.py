"""The environment app's worker task: reopening failed cleanups whose back-off is over
(docs/worker.md#tasks)."""

from __future__ import annotations

from django.conf import settings
from procrastinate.contrib.django import app

from leases.environment.services import environment_cleanups_retry_due
from paperclip.worker.schedule import cron_every


@app.periodic(
    cron=cron_every(
        settings.PAPERCLIP_CLEANUP_RETRY_INTERVAL_SECONDS,
        setting="PAPERCLIP_CLEANUP_RETRY_INTERVAL_SECONDS",
    ),
    periodic_id="retry_environment_cleanups",
)
@app.task(
    name="retry_environment_cleanups",
    queue="maintenance",
    queueing_lock="retry_environment_cleanups",
)
def retry_environment_cleanups(timestamp: int) -> str:
    """Every PAPERCLIP_CLEANUP_RETRY_INTERVAL_SECONDS: failed cleanups past their back-off
    become pending again (claims before that get `cleanup_retry_not_due`)."""
    sweep = environment_cleanups_retry_due()
    return f"examined {sweep.examined}, reopened {len(sweep.reopened)}"
