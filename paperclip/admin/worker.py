"""Admin pages of the worker (docs/worker.md#admin-pages): its processes, job errors, periodic
task runs and jobs. Jobs are not company-scoped (their arguments name any company's runs), so
these pages are for superusers only. They read; Procrastinate's own job actions (retry,
cancel) stay available on the job list.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib import admin
from django.db.models import Count, Max, OuterRef, QuerySet, Subquery
from django.http import HttpRequest
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html
from procrastinate.contrib.django import app as procrastinate_app
from procrastinate.contrib.django.admin import ProcrastinateJobAdmin
from procrastinate.contrib.django.models import (
    ProcrastinateJob,
    ProcrastinatePeriodicDefer,
    ProcrastinateWorker,
)

from paperclip.admin.toolkit import NoWritesMixin
from paperclip.models import (
    JobError,
    WorkerProcess,
)


class _SuperuserReadOnly(NoWritesMixin, admin.ModelAdmin):  # type: ignore[type-arg]
    def has_module_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.is_active and request.user.is_superuser)

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return self.has_module_permission(request)


def _job_link(job_id: int | None) -> str:
    if not job_id:
        return "—"
    url = reverse("admin:procrastinate_procrastinatejob_change", args=[job_id])
    return format_html('<a href="{}">job {}</a>', url, job_id)


@admin.register(WorkerProcess)
class WorkerProcessAdmin(_SuperuserReadOnly):
    list_display = (
        "worker_id",
        "hostname",
        "pid",
        "liveness",
        "last_heartbeat",
        "running_jobs",
        "concurrency",
        "queue_list",
        "registered_at",
        "stopped_at",
    )
    list_filter = ("hostname",)
    search_fields = ("hostname", "pid")

    def get_queryset(self, request: HttpRequest) -> QuerySet[WorkerProcess]:
        heartbeat = ProcrastinateWorker.objects.filter(id=OuterRef("worker_id"))
        running = ProcrastinateJob.objects.filter(worker_id=OuterRef("worker_id"), status="doing")
        return (
            super()
            .get_queryset(request)
            .annotate(
                heartbeat_at=Subquery(heartbeat.values("last_heartbeat")[:1]),
                doing=Subquery(
                    running.order_by().values("worker_id").annotate(n=Count("id")).values("n")[:1]
                ),
            )
        )

    @admin.display(description="last heartbeat (UTC)", ordering="heartbeat_at")
    def last_heartbeat(self, obj: WorkerProcess) -> Any:
        return getattr(obj, "heartbeat_at", None) or "—"

    @admin.display(description="state")
    def liveness(self, obj: WorkerProcess) -> str:
        if obj.stopped_at is not None:
            return "stopped"
        beat = getattr(obj, "heartbeat_at", None)
        if beat is None:
            return "gone (pruned)"
        fresh = timezone.now() - beat < timedelta(
            seconds=settings.PAPERCLIP_WORKER_STALLED_AFTER_SECONDS
        )
        return "alive" if fresh else "stale"

    @admin.display(description="running jobs")
    def running_jobs(self, obj: WorkerProcess) -> int:
        return getattr(obj, "doing", None) or 0

    @admin.display(description="queues")
    def queue_list(self, obj: WorkerProcess) -> str:
        return ", ".join(obj.queues) if obj.queues else "all"


@admin.register(JobError)
class JobErrorAdmin(_SuperuserReadOnly):
    list_display = ("occurred_at", "job", "task_name", "attempt", "error", "worker_id")
    list_filter = ("task_name",)
    search_fields = ("error", "job_id")
    fields = ("occurred_at", "job", "task_name", "attempt", "worker_id", "error", "traceback")
    readonly_fields = fields

    @admin.display(description="job")
    def job(self, obj: JobError) -> str:
        return _job_link(obj.job_id)


class _LatestPerTask(admin.SimpleListFilter):
    title = "history"
    parameter_name = "history"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("all", "every period")]

    def queryset(
        self, request: HttpRequest, queryset: QuerySet[ProcrastinatePeriodicDefer]
    ) -> QuerySet[ProcrastinatePeriodicDefer]:
        if self.value() == "all":
            return queryset
        latest = (
            ProcrastinatePeriodicDefer.objects.order_by()
            .values("task_name", "periodic_id")
            .annotate(last=Max("id"))
            .values("last")
        )
        return queryset.filter(id__in=latest)


@admin.register(ProcrastinatePeriodicDefer)
class PeriodicTaskRunAdmin(_SuperuserReadOnly):
    """The last run of each periodic task (filter "every period" for the history)."""

    list_display = ("task_name", "schedule", "deferred_for", "job_status", "job", "last_error")
    list_filter = (_LatestPerTask, "task_name")
    ordering = ("task_name", "-defer_timestamp")

    def get_queryset(self, request: HttpRequest) -> QuerySet[ProcrastinatePeriodicDefer]:
        return super().get_queryset(request).select_related("job")

    @admin.display(description="schedule (cron, UTC)")
    def schedule(self, obj: ProcrastinatePeriodicDefer) -> str:
        periodic = procrastinate_app.periodic_registry.periodic_tasks.get(
            (obj.task_name, obj.periodic_id)
        )
        return periodic.cron if periodic is not None else "(no longer registered)"

    @admin.display(description="period (UTC)", ordering="defer_timestamp")
    def deferred_for(self, obj: ProcrastinatePeriodicDefer) -> Any:
        if obj.defer_timestamp is None:
            return "—"
        return datetime.fromtimestamp(obj.defer_timestamp, tz=UTC)

    @admin.display(description="outcome")
    def job_status(self, obj: ProcrastinatePeriodicDefer) -> str:
        return obj.job.status if obj.job is not None else "removed"

    @admin.display(description="job")
    def job(self, obj: ProcrastinatePeriodicDefer) -> str:
        return _job_link(obj.job_id)

    @admin.display(description="error")
    def last_error(self, obj: ProcrastinatePeriodicDefer) -> str:
        if obj.job_id is None:
            return ""
        error = JobError.objects.filter(job_id=obj.job_id).order_by("-id").first()
        return error.error[:200] if error is not None else ""


class JobWithErrorAdmin(ProcrastinateJobAdmin, _SuperuserReadOnly):
    """Procrastinate's job admin, for superusers, with the error each failed job ended with."""

    list_display = [*ProcrastinateJobAdmin.list_display, "error"]

    @admin.display(description="error")
    def error(self, obj: ProcrastinateJob) -> str:
        if obj.status != "failed":
            return ""
        found = JobError.objects.filter(job_id=obj.pk).order_by("-id").first()
        return found.error[:200] if found is not None else "(no error recorded)"


admin.site.unregister(ProcrastinateJob)
admin.site.register(ProcrastinateJob, JobWithErrorAdmin)
