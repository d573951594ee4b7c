"""The console's pages that gather every app's rows: a run's page (its coordinator, leases,
recovery actions, checkpoint parts, operations and audit rows, with "Finalize now") and the
audit log, whose entity ids link to each app's page.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.contrib.admin.views.main import ChangeList
from django.db.models import QuerySet
from django.http import HttpRequest
from django.template.loader import render_to_string
from django.utils.html import format_html
from django.utils.safestring import SafeString

from leases.orphans import orphaned_runs, run_orphaned_since
from paperclip.admin.bulk import BulkByFilterMixin
from paperclip.admin.lists import IndexedValuesListFilter, recent_filter
from paperclip.admin.toolkit import (
    COMPANY_FILTER,
    ReadOnlyAdmin,
    console_panel,
    named_link,
    short_id,
)
from paperclip.models import (
    ActivityEvent,
    Agent,
    HeartbeatRun,
    Issue,
    NativeRunFinalization,
)
from paperclip.templatetags.console import relative, stamp
from recovery.admin.finalization import FinalizeNowMixin, hold_detail_action, hold_panel
from recovery.console.interrupt import INTERRUPT_BULK, InterruptRunMixin
from recovery.console.names import AuditNames, audit_names
from recovery.console.run_related import RELATED_LIMIT, run_related
from recovery.console.run_timeline import run_timeline
from recovery.selectors.actions import run_board_hold
from recovery.selectors.finalization import finalization_state


class NativePhaseFilter(admin.SimpleListFilter):
    """The coordinator phases a native run records (a fixed list: the stock filter would read
    the distinct values of every run)."""

    title = "native phase"
    parameter_name = "native_phase"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(value, str(label)) for value, label in NativeRunFinalization.Phase.choices]

    def queryset(
        self, request: HttpRequest, queryset: QuerySet[HeartbeatRun]
    ) -> QuerySet[HeartbeatRun]:
        value = self.value()
        return queryset.filter(native_phase=value) if value else queryset


class OrphanedFilter(admin.SimpleListFilter):
    """Running runs every lease of which lapsed (the dashboard's "Orphaned runs" tile)."""

    title = "orphaned"
    parameter_name = "orphaned"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("yes", "Orphaned (every lease lapsed)")]

    def queryset(
        self, request: HttpRequest, queryset: QuerySet[HeartbeatRun]
    ) -> QuerySet[HeartbeatRun]:
        if self.value() != "yes":
            return queryset
        return queryset.filter(pk__in=[o.run_id for o in orphaned_runs(limit=10_000)])


@admin.register(HeartbeatRun)
class HeartbeatRunAdmin(BulkByFilterMixin, InterruptRunMixin, FinalizeNowMixin, ReadOnlyAdmin):
    # Names beside short ids, and short columns: the list fits a 1366 px screen.
    list_display = (
        "run",
        "company",
        "agent_named",
        "issue_named",
        "status",
        "runtime_mode",
        "native_phase",
        "created",
        "finished",
    )
    list_display_links = ("run",)
    list_filter = (
        "status",
        OrphanedFilter,
        "runtime_mode",
        NativePhaseFilter,
        recent_filter("created_at", "created"),
        COMPANY_FILTER,
    )
    search_fields = ("=id", "agent__name", "issue__title", "=issue__id")
    list_select_related = ("company", "agent", "issue")
    actions = ("finalize_now", "interrupt_selected")
    bulk_actions = (INTERRUPT_BULK,)
    readonly_fields = ("related_objects",)
    fieldsets = (
        (
            None,
            {
                "fields": (
                    "id",
                    "company",
                    "agent",
                    "issue",
                    "native_issue",
                    "execution_workspace",
                    "status",
                    "runtime_mode",
                    "native_phase",
                    "native_phase_updated_at",
                    "execution_stage",
                    "created_at",
                    "started_at",
                    "finished_at",
                )
            },
        ),
        ("Related", {"fields": ("related_objects",)}),
        (
            "Controller and profile",
            {
                "classes": ("collapse",),
                "fields": (
                    "controller_boot_id",
                    "controller_lease_expires_at",
                    "process_pid",
                    "process_started_at",
                    "completion_contract_id",
                    "native_session_id",
                    "runner_profile_json",
                    "context_snapshot",
                    "result_json",
                ),
            },
        ),
    )

    def get_queryset(self, request: HttpRequest) -> QuerySet[HeartbeatRun]:
        # The page title names the agent and the issue (detail_title).
        return super().get_queryset(request).select_related("company", "agent", "issue")

    @admin.display(description="run", ordering="id")
    def run(self, obj: HeartbeatRun) -> SafeString:
        return format_html('<code title="{}">{}</code>', obj.pk, short_id(obj.pk))

    @admin.display(description="agent", ordering="agent__name")
    def agent_named(self, obj: HeartbeatRun) -> SafeString | str:
        return named_link(Agent, obj.agent_id, obj.agent.name, limit=24)

    @admin.display(description="issue", ordering="issue__title")
    def issue_named(self, obj: HeartbeatRun) -> SafeString | str:
        issue = obj.issue
        if issue is None:
            return "—"
        return named_link(Issue, issue.pk, issue.title, limit=32)

    @admin.display(description="created (UTC)", ordering="created_at")
    def created(self, obj: HeartbeatRun) -> SafeString | str:
        return stamp(obj.created_at)

    @admin.display(description="finished (UTC)", ordering="finished_at")
    def finished(self, obj: HeartbeatRun) -> SafeString | str:
        return stamp(obj.finished_at) if obj.finished_at else "—"

    def detail_title(self, obj: HeartbeatRun) -> str:
        on = f" on “{obj.issue.title}”" if obj.issue is not None else ""
        return f"run {short_id(obj.pk)} of {obj.agent.name}{on}"

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return [
            "related_objects",
            *(f.name for f in HeartbeatRun._meta.fields),
        ]

    def timeline_run_id(self, obj: HeartbeatRun) -> Any:
        return obj.pk

    @admin.display(
        description="timeline, coordinator, leases, actions, checkpoints, operations, audit"
    )
    def related_objects(self, obj: HeartbeatRun) -> SafeString:
        related = run_related(obj)
        state = (
            finalization_state(obj, coordinator=related.coordinator)
            if related.coordinator is not None
            else None
        )
        return SafeString(  # rendered through an autoescaping template
            render_to_string(
                "admin/console/run_related.html",
                {
                    "run": obj,
                    "related": related,
                    "finalization": state,
                    "timeline": run_timeline(obj, related),
                    "limit": RELATED_LIMIT,
                },
            )
        )

    def detail_panels(self, request: HttpRequest, obj: HeartbeatRun) -> list[SafeString]:
        # A hold comes first: it is what the board must act on before anything else moves.
        hold = run_board_hold(company_id=obj.company_id, run_id=obj.pk)
        panels = [hold_panel(hold)] if hold is not None else []
        since = run_orphaned_since(obj.pk) if obj.status == HeartbeatRun.Status.RUNNING else None
        if since is None:
            return panels
        return [
            *panels,
            console_panel(
                panel_id="orphaned-verdict",
                state="orphaned",
                title="Orphaned: every lease of this run lapsed",
                headline=(
                    "Its agent is gone: nothing has renewed its leases since "
                    f"{since:%Y-%m-%d %H:%M:%S} UTC ({relative(since)})."
                ),
                lines=(
                    "The worker interrupts it once PAPERCLIP_ORPHANED_RUN_GRACE_SECONDS have "
                    "passed, and so does the next run that starts on its issue.",
                    "To end it now and release its issue: Interrupt run…",
                ),
            ),
        ]

    def detail_actions(self, request: HttpRequest, obj: HeartbeatRun) -> list[dict[str, Any]]:
        actions: list[dict[str, Any]] = []
        if obj.runtime_mode == HeartbeatRun.RuntimeMode.NATIVE:
            coordinator = NativeRunFinalization.objects.filter(run_id=obj.pk).first()
            hold = run_board_hold(company_id=obj.company_id, run_id=obj.pk)
            if hold is not None:
                # Finalize now would only queue a job that logs "not acquired".
                actions.append(hold_detail_action(hold))
            elif (
                coordinator is not None
                and coordinator.result_id is not None
                and coordinator.phase != "committed"
            ):
                actions.append({"action": "finalize_now", "label": "Finalize now", "primary": True})
        if not obj.is_terminal:
            orphaned = obj.status == HeartbeatRun.Status.RUNNING and bool(
                orphaned_runs(run_ids=[obj.pk], limit=1)
            )
            actions.append(
                {"action": "interrupt_selected", "label": "Interrupt run…", "primary": orphaned}
            )
        return actions

    @admin.action(description="Finalize selected runs now", permissions=["finalize"])
    def finalize_now(self, request: HttpRequest, queryset: QuerySet[HeartbeatRun]) -> None:
        self._finalize_each(request, list(queryset.order_by("pk").values_list("company_id", "pk")))


def _names_of(event: ActivityEvent) -> AuditNames:
    names = getattr(event, "console_names", None)
    return names if names is not None else audit_names([event])


class _NamedAuditChangeList(ChangeList):
    """The audit log's page, with the names behind its ids read once for the whole page."""

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        rows: list[ActivityEvent] = list(self.result_list)  # fills the page's result cache
        names = audit_names(rows)
        for row in rows:  # per row, not on the (shared) model admin
            row.console_names = names  # type: ignore[attr-defined]


@admin.register(ActivityEvent)
class ActivityEventAdmin(ReadOnlyAdmin):
    list_display = (
        "created",
        "company",
        "action",
        "actor",
        "entity_type",
        "entity",
    )
    list_select_related = ("company",)

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return _NamedAuditChangeList

    @admin.display(description="when (UTC)", ordering="created_at")
    def created(self, obj: ActivityEvent) -> SafeString | str:
        return stamp(obj.created_at)

    @admin.display(description="actor", ordering="actor_id")
    def actor(self, obj: ActivityEvent) -> SafeString | str:
        if obj.actor_type != "agent":
            return format_html("{} <code>{}</code>", obj.actor_type, obj.actor_id[:24])
        return _names_of(obj).actor(obj)

    @admin.display(description="entity", ordering="entity_id")
    def entity(self, obj: ActivityEvent) -> SafeString | str:
        return _names_of(obj).entity_link(obj)

    # No date_hierarchy and no stock "all values" filters: their links read every row
    # (paperclip.admin.lists).
    list_filter = (
        ("action", IndexedValuesListFilter),
        "actor_type",
        ("entity_type", IndexedValuesListFilter),
        recent_filter("created_at", "when"),
        COMPANY_FILTER,
    )
    search_fields = ("entity_id", "actor_id")
