"""`manage.py remove_old_jobs`: the daily periodic task of the same name, run once now."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand

from paperclip.worker.upkeep import OldJobsRemoval, old_jobs_remove, with_job_manager


class Command(BaseCommand):
    help = (
        "Remove finished jobs (failed ones too, with their recorded errors) and registrations "
        "of workers stopped more than PAPERCLIP_JOB_RETENTION_HOURS ago. The worker runs this "
        "daily by itself."
    )

    def handle(self, *args: Any, **options: Any) -> None:
        self.stdout.write(
            f"removing what finished more than {settings.PAPERCLIP_JOB_RETENTION_HOURS} h ago"
        )
        removal: OldJobsRemoval = with_job_manager(lambda manager: old_jobs_remove(manager=manager))
        self.stdout.write(removal.text)
