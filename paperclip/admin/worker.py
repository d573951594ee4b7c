"""Admin pages of the worker (docs/worker.md#admin-pages): its processes, job errors, periodic
task runs and jobs. Jobs are not company-scoped (their arguments name any company's runs), so
these pages are for superusers only. They read; Procrastinate's own job actions (retry,
cancel) stay available on the job list.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

from django.conf import settings
from django.contrib import admin
from django.contrib.admin.views.main import ChangeList
from django.db.models import Count, Max, OuterRef, QuerySet, Subquery
from django.http import HttpRequest
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString
from procrastinate.contrib.django import app as procrastinate_app
from procrastinate.contrib.django.admin import ProcrastinateJobAdmin
from procrastinate.contrib.django.models import (
    ProcrastinateJob,
    ProcrastinatePeriodicDefer,
    ProcrastinateWorker,
)

from paperclip.admin.names import CORE_KINDS, names_by_kind
from paperclip.admin.toolkit import NoWritesMixin, named_link, short_id
from paperclip.ids import parse_uuid
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


# The job arguments that name a console object, and the kind of object each names.
JOB_ARG_KINDS: dict[str, str] = {
    "company_id": "company",
    "agent_id": "agent",
    "issue_id": "issue",
    "run_id": "heartbeat_run",
    "workspace_id": "execution_workspace",
    "execution_workspace_id": "execution_workspace",
}


def _job_ids(job: ProcrastinateJob) -> list[tuple[str, str, UUID]]:
    """(argument, kind, id) of each of the job's arguments that names a console object."""
    args = job.args if isinstance(job.args, dict) else {}
    found = []
    for arg, kind in JOB_ARG_KINDS.items():
        uid = parse_uuid(args.get(arg))
        if uid is not None:
            found.append((arg, kind, uid))
    return found


def job_page_names(jobs: list[ProcrastinateJob]) -> dict[tuple[str, UUID], str]:
    """The names behind the jobs' arguments (one query per kind of object named)."""
    wanted: dict[str, set[UUID]] = defaultdict(set)
    for job in jobs:
        for _arg, kind, uid in _job_ids(job):
            wanted[kind].add(uid)
    return names_by_kind(wanted, CORE_KINDS)


def job_last_errors(jobs: list[ProcrastinateJob]) -> dict[int, str]:
    """The last error of each failed job among `jobs`, in one query."""
    failed = [job.pk for job in jobs if job.status == "failed"]
    if not failed:
        return {}
    rows = (
        JobError.objects.filter(job_id__in=failed)
        .order_by("job_id", "-id")
        .distinct("job_id")
        .values_list("job_id", "error")
    )
    return dict(rows)


class _NamedJobChangeList(ChangeList):
    """The job list, with the names behind its arguments and its errors read once per page."""

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        jobs: list[ProcrastinateJob] = list(self.result_list)
        names = job_page_names(jobs)
        errors = job_last_errors(jobs)
        for job in jobs:  # per row, not on the (shared) model admin
            job.console_names = names  # type: ignore[attr-defined]
            job.console_errors = errors  # type: ignore[attr-defined]


class JobWithErrorAdmin(ProcrastinateJobAdmin, _SuperuserReadOnly):
    """Procrastinate's job admin, for superusers, with what each job is about (the names
    behind the ids in its arguments) and the error each failed job ended with."""

    list_display = [*ProcrastinateJobAdmin.list_display, "about", "error"]

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return _NamedJobChangeList

    @admin.display(description="about")
    def about(self, obj: ProcrastinateJob) -> SafeString | str:
        names = getattr(obj, "console_names", None)
        if names is None:
            names = job_page_names([obj])
        links = [
            named_link(
                CORE_KINDS[kind].model,
                uid,
                names.get((kind, uid), f"{kind.replace('_', ' ')} {short_id(uid)}"),
                limit=24,
            )
            for _arg, kind, uid in _job_ids(obj)
        ]
        if not links:
            return "—"
        return format_html_join(SafeString("<br>"), "{}", ((link,) for link in links))

    @admin.display(description="error")
    def error(self, obj: ProcrastinateJob) -> str:
        if obj.status != "failed":
            return ""
        errors = getattr(obj, "console_errors", None)
        if errors is None:
            errors = job_last_errors([obj])
        found = errors.get(obj.pk)
        return found[:200] if found is not None else "(no error recorded)"


admin.site.unregister(ProcrastinateJob)
admin.site.register(ProcrastinateJob, JobWithErrorAdmin)
