"""`manage.py recover_stalled_jobs`: the periodic task of the same name, run once now."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand
from procrastinate.jobs import Job

from paperclip.worker.upkeep import StalledRecovery, stalled_jobs_recover, with_job_manager


class Command(BaseCommand):
    help = (
        "Retry the running jobs of workers whose heartbeat is older than "
        "PAPERCLIP_WORKER_STALLED_AFTER_SECONDS (killed, frozen, cut off); a job whose work "
        "is already queued again is closed instead. The worker runs this every "
        "PAPERCLIP_STALLED_JOB_INTERVAL_SECONDS by itself."
    )

    def handle(self, *args: Any, **options: Any) -> None:
        def said(job: Job, outcome: str) -> None:
            self.stdout.write(f"  job {job.id} ({job.task_name}): {outcome}")

        self.stdout.write(
            "looking for jobs of workers silent for more than "
            f"{settings.PAPERCLIP_WORKER_STALLED_AFTER_SECONDS:g} s"
        )
        recovery: StalledRecovery = with_job_manager(
            lambda manager: stalled_jobs_recover(manager=lambda: manager, on_job=said)
        )
        self.stdout.write(recovery.text)
