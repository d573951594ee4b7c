"""The checkpoints app's worker task: expiring lapsed runner authorities (docs/worker.md#tasks)."""

from __future__ import annotations

from django.conf import settings
from procrastinate.contrib.django import app

from checkpoints.services import expired_authorities_sweep
from paperclip.worker.schedule import cron_every


@app.periodic(
    cron=cron_every(
        settings.PAPERCLIP_AUTHORITY_EXPIRY_INTERVAL_SECONDS,
        setting="PAPERCLIP_AUTHORITY_EXPIRY_INTERVAL_SECONDS",
    ),
    periodic_id="expire_runner_authorities",
)
@app.task(
    name="expire_runner_authorities",
    queue="maintenance",
    queueing_lock="expire_runner_authorities",
)
def expire_runner_authorities(timestamp: int) -> str:
    """`manage.py expire_runner_authorities`, every PAPERCLIP_AUTHORITY_EXPIRY_INTERVAL_SECONDS."""
    sweep = expired_authorities_sweep()
    return f"found {sweep.found}, expired {sweep.expired}, skipped {sweep.skipped}"
