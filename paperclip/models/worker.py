"""The background worker's own rows, beside Procrastinate's tables: where each worker runs,
and the exception each failed job ended with."""

from __future__ import annotations

from typing import ClassVar

from django.db import models
from django.db.models.functions import Now


class WorkerProcess(models.Model):
    """A worker process as it registered itself (docs/worker.md#workers-and-their-heartbeats).

    Procrastinate keeps each worker's heartbeat in `procrastinate_workers` (id and time only);
    this row adds where the worker runs, keyed by that same id. A worker that stopped cleanly has
    `stopped_at`; one that vanished keeps its last heartbeat until Procrastinate prunes it.
    """

    worker_id = models.BigIntegerField(primary_key=True)
    hostname = models.TextField()
    pid = models.IntegerField()
    process_started_at = models.DateTimeField()
    # The machine boot it ran under (paperclip/host.py): with the host name, it tells this
    # boot's pid from a reused one. Null when unreadable, and on rows from before it existed.
    kernel_boot_id = models.TextField(null=True, blank=True)
    concurrency = models.IntegerField()
    queues = models.JSONField(default=list, blank=True)  # [] = every queue
    registered_at = models.DateTimeField(db_default=Now(), editable=False)
    stopped_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "worker_processes"
        ordering: ClassVar[list[str]] = ["-registered_at"]
        verbose_name_plural = "worker processes"

    def __str__(self) -> str:
        return f"worker {self.worker_id} on {self.hostname} (pid {self.pid})"


class JobError(models.Model):
    """The exception a job ended with (Procrastinate records only that it failed)."""

    id = models.BigAutoField(primary_key=True)
    job_id = models.BigIntegerField(db_index=True)
    task_name = models.TextField()
    attempt = models.IntegerField()
    error = models.TextField()
    traceback = models.TextField(blank=True, default="")
    worker_id = models.BigIntegerField(null=True, blank=True)
    occurred_at = models.DateTimeField(db_default=Now(), editable=False)

    class Meta:
        db_table = "job_errors"
        ordering: ClassVar[list[str]] = ["-occurred_at"]

    def __str__(self) -> str:
        return f"job {self.job_id} ({self.task_name}): {self.error[:80]}"
