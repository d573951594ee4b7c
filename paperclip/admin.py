"""Admin for the core models.

The board sets up companies, memberships, agents, issues and execution workspaces here as
ordinary editable records (each save writes an audit row). Records whose state changes only
through services (runs, coordinators, results, workspace operations, the audit log, credentials)
are read-only; credentials are revoked through an action that calls the service.

Staff users who are not superusers see only the companies they are board members of.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, ClassVar

from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.db.models import Count, Max, OuterRef, Q, QuerySet, Subquery
from django.http import HttpRequest, HttpResponse
from django.template.loader import render_to_string
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString
from procrastinate.contrib.django import app as procrastinate_app
from procrastinate.contrib.django.admin import ProcrastinateJobAdmin
from procrastinate.contrib.django.models import (
    ProcrastinateJob,
    ProcrastinatePeriodicDefer,
    ProcrastinateWorker,
)

from leases.models import EnvironmentLease
from paperclip.activity import activity_record
from paperclip.admin_lists import FlatCostListMixin, IndexedValuesListFilter, recent_filter
from paperclip.admin_site import member_company_ids
from paperclip.credentials import agent_key_revoke, board_token_revoke
from paperclip.errors import DomainError
from paperclip.ids import parse_uuid
from paperclip.models import (
    ActivityEvent,
    Agent,
    AgentApiKey,
    BoardApiToken,
    BoardMembership,
    Company,
    ExecutionWorkspace,
    ExecutionWorkspaceSnapshot,
    HeartbeatRun,
    Issue,
    JobError,
    NativeRunFinalization,
    NativeRunResult,
    WorkerProcess,
    WorkspaceOperation,
)
from paperclip.selectors.attention import (
    expired_authority_coordinators,
    failed_finalizations,
    retrying_finalizations,
)
from paperclip.selectors.run_related import run_related
from paperclip.services import absolute_path_error
from paperclip.templatetags.console import stamp
from recovery.models import IssueRecoveryAction
from recovery.selectors.finalization import finalization_state
from recovery.services import finalization_request

# Django's admin and form classes are not subscriptable at runtime (no django-stubs-ext patch).
if TYPE_CHECKING:
    _ModelAdmin = admin.ModelAdmin[Any]
    _TabularInline = admin.TabularInline[Any, Any]
    _ModelForm = forms.ModelForm[Any]
else:
    _ModelAdmin = admin.ModelAdmin
    _TabularInline = admin.TabularInline
    _ModelForm = forms.ModelForm


class CompanyListFilter(admin.RelatedFieldListFilter):
    """The company filter, offering only the operator's companies (the stock one would list
    every company's name to any staff user)."""

    def field_choices(self, field: Any, request: HttpRequest, model_admin: Any) -> list[Any]:
        ids = member_company_ids(request)
        companies = Company.objects.order_by("name")
        if ids is not None:
            companies = companies.filter(pk__in=ids)
        return [(c.pk, c.name) for c in companies]


COMPANY_FILTER = ("company", CompanyListFilter)


def console_panel(
    *,
    panel_id: str,
    state: str,
    title: str,
    headline: str,
    lines: list[str] | tuple[str, ...] = (),
    ok: bool = False,
) -> SafeString:
    """A "why, in words" panel for the top of a detail page (rendered with autoescaping)."""
    return SafeString(
        render_to_string(
            "admin/console/panel.html",
            {
                "panel_id": panel_id,
                "state": state,
                "title": title,
                "headline": headline,
                "lines": lines,
                "ok": ok,
            },
        )
    )


def admin_link(obj: Any, label: Any = None) -> SafeString | str:
    """A link to `obj`'s admin page (its change view); plain text if it has none. Pages are
    company-scoped, so a link never shows more than the operator may see."""
    if obj is None:
        return "—"
    opts = obj._meta
    if not admin.site.is_registered(type(obj)):
        return str(label if label is not None else obj)
    url = reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[obj.pk])
    return format_html('<a href="{}">{}</a>', url, label if label is not None else obj)


def admin_id_link(model: Any, pk: Any, label: Any = None) -> SafeString | str:
    """A link to the object of `model` with primary key `pk` (not loaded)."""
    if pk is None:
        return "—"
    opts = model._meta
    url = reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[pk])
    return format_html('<a href="{}">{}</a>', url, label if label is not None else pk)


class ActivityTimelineMixin:
    """The HISTORY page of a state-bearing object is its audit timeline: the ActivityEvent
    rows naming it (`timeline_entity_ids`) or, for runs, carrying its run id."""

    timeline_limit: int = 500

    def timeline_entity_ids(self, obj: Any) -> list[str]:
        return [str(obj.pk)]

    def timeline_run_id(self, obj: Any) -> Any:
        return None

    def history_view(
        self, request: HttpRequest, object_id: str, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        model_admin: Any = self
        obj = model_admin.get_object(request, unquote(object_id))
        if obj is None:
            return model_admin._get_obj_does_not_exist_redirect(
                request, model_admin.model._meta, object_id
            )
        if not model_admin.has_view_or_change_permission(request, obj):
            raise PermissionDenied
        condition = Q(entity_id__in=self.timeline_entity_ids(obj))
        run_id = self.timeline_run_id(obj)
        if run_id is not None:
            condition |= Q(run_id=run_id)
        events = ActivityEvent.objects.filter(condition)
        company_id = getattr(obj, "company_id", None)
        if company_id is not None:
            events = events.filter(company_id=company_id)
        ids = member_company_ids(request)
        if ids is not None:
            events = events.filter(company_id__in=ids)
        rows = list(events.order_by("-created_at", "-id")[: self.timeline_limit])
        opts = model_admin.model._meta
        context = {
            **model_admin.admin_site.each_context(request),
            "title": f"Activity of {obj}",
            "subtitle": None,
            "object": obj,
            "opts": opts,
            "events": [
                (event, json.dumps(event.details, indent=2, sort_keys=True)) for event in rows
            ],
            "limit": self.timeline_limit,
            **(extra_context or {}),
        }
        return TemplateResponse(request, "admin/console/timeline.html", context)


class DetailActionsMixin:
    """Actions as buttons on the detail page: each button posts the object to the changelist's
    own action (same confirmation page, same service, same permission), and panels that say
    in words why the object needs attention appear above its fields."""

    change_form_template: ClassVar[Any] = "admin/console/change_form.html"

    def detail_actions(self, request: HttpRequest, obj: Any) -> list[dict[str, Any]]:
        return []

    def detail_panels(self, request: HttpRequest, obj: Any) -> list[SafeString]:
        return []

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        model_admin: Any = self
        obj = model_admin.get_object(request, unquote(object_id))
        extra = dict(extra_context or {})
        if obj is not None:
            actions = model_admin.get_actions(request)
            extra["console_actions"] = [
                item for item in self.detail_actions(request, obj) if item["action"] in actions
            ]
            extra["console_panels"] = self.detail_panels(request, obj)
        response: HttpResponse = super().change_view(  # type: ignore[misc]
            request, object_id, form_url, extra
        )
        return response


class CompanyScopedAdmin(FlatCostListMixin, DetailActionsMixin, ActivityTimelineMixin, _ModelAdmin):
    """Limits rows (and foreign-key choices) to the user's companies; lists count at most
    LIST_COUNT_CAP rows (paperclip.admin_lists)."""

    company_lookup = "company_id"

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        queryset = super().get_queryset(request)
        ids = member_company_ids(request)
        if ids is None:
            return queryset
        return queryset.filter(**{f"{self.company_lookup}__in": ids})

    def formfield_for_foreignkey(
        self, db_field: Any, request: HttpRequest, **kwargs: Any
    ) -> forms.ModelChoiceField[Any] | None:
        ids = member_company_ids(request)
        if ids is not None:
            related = db_field.related_model
            if related is Company:
                kwargs["queryset"] = Company.objects.filter(pk__in=ids)
            elif any(f.name == "company" for f in related._meta.fields):
                kwargs["queryset"] = related.objects.filter(company_id__in=ids)
        return super().formfield_for_foreignkey(db_field, request, **kwargs)


class ReadOnlyAdmin(CompanyScopedAdmin):
    """State that changes only through services: browse, never add, edit or delete."""

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class AuditedAdmin(CompanyScopedAdmin):
    """Editable setup records: every admin save writes one audit row in its transaction."""

    audit_entity: str = ""

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        super().save_model(request, obj, form, change)
        company_id = obj.pk if isinstance(obj, Company) else getattr(obj, "company_id", None)
        activity_record(
            company_id=company_id,
            actor_type=ActivityEvent.ActorType.USER,
            actor_id=str(request.user.pk),
            action=f"{self.audit_entity}.{'updated' if change else 'created'}",
            entity_type=self.audit_entity,
            entity_id=str(obj.pk),
            details={"via": "admin", "fields": sorted(form.changed_data)},
        )


@admin.register(Company)
class CompanyAdmin(AuditedAdmin):
    company_lookup = "id"
    audit_entity = "company"
    list_display = ("name", "id", "created_at")
    search_fields = ("name", "id")
    readonly_fields = ("id", "created_at", "updated_at")

    def has_add_permission(self, request: HttpRequest) -> bool:
        # As in the API: only superusers create companies.
        return bool(getattr(request.user, "is_superuser", False))


@admin.register(BoardMembership)
class BoardMembershipAdmin(AuditedAdmin):
    audit_entity = "board_membership"
    list_display = ("user", "company", "created_at")
    list_filter = (COMPANY_FILTER,)
    search_fields = ("user__username", "company__name")
    autocomplete_fields = ("company",)
    readonly_fields = ("created_at",)


class AgentApiKeyInline(_TabularInline):
    model = AgentApiKey
    extra = 0
    can_delete = False
    fields = ("prefix", "name", "created_at", "last_used_at", "revoked_at")
    readonly_fields = fields
    show_change_link = True

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Agent)
class AgentAdmin(AuditedAdmin):
    audit_entity = "agent"
    list_display = ("name", "company", "role", "status", "id", "created_at")
    list_filter = ("role", "status", COMPANY_FILTER)
    search_fields = ("name", "id")
    autocomplete_fields = ("company",)
    readonly_fields = ("id", "created_at", "updated_at")
    inlines = (AgentApiKeyInline,)


class _CredentialAdmin(ReadOnlyAdmin):
    @admin.display(boolean=True, description="active")
    def active(self, obj: AgentApiKey | BoardApiToken) -> bool:
        return obj.revoked_at is None

    def _revoke_each(self, request: HttpRequest, ids: list[Any], revoke: Any, arg: str) -> None:
        revoked, unchanged, failed = 0, 0, []
        for pk in ids:
            try:
                result = revoke(**{arg: pk}, actor_type="user", actor_id=str(request.user.pk))
            except DomainError as exc:
                failed.append(f"{pk}: {exc.code}")
                continue
            if result.changed:
                revoked += 1
            else:
                unchanged += 1
        level = messages.WARNING if failed else messages.SUCCESS
        self.message_user(
            request,
            f"Revoked {revoked}; already revoked {unchanged}; "
            f"failed: {', '.join(failed) or 'none'}",
            level,
        )


@admin.register(AgentApiKey)
class AgentApiKeyAdmin(_CredentialAdmin):
    company_lookup = "agent__company_id"
    list_display = ("__str__", "agent", "name", "active", "created_at", "last_used_at")
    list_filter = (
        ("revoked_at", admin.EmptyFieldListFilter),
        ("agent__company", CompanyListFilter),
    )
    search_fields = ("prefix", "name", "agent__name", "agent__id")
    list_select_related = ("agent",)
    exclude = ("secret_sha256",)
    actions = ("revoke_selected",)

    @admin.action(description="Revoke selected agent keys", permissions=["revoke"])
    def revoke_selected(self, request: HttpRequest, queryset: QuerySet[AgentApiKey]) -> None:
        ids = list(queryset.order_by("pk").values_list("pk", flat=True))
        self._revoke_each(request, ids, agent_key_revoke, "key_id")

    def has_revoke_permission(self, request: HttpRequest) -> bool:
        # Visible keys belong to the user's companies (get_queryset); board staff may revoke them.
        return bool(getattr(request.user, "is_staff", False))


@admin.register(BoardApiToken)
class BoardApiTokenAdmin(_CredentialAdmin):
    list_display = ("__str__", "user", "name", "active", "created_at", "last_used_at")
    list_filter = (("revoked_at", admin.EmptyFieldListFilter),)
    search_fields = ("prefix", "name", "user__username")
    list_select_related = ("user",)
    exclude = ("secret_sha256",)
    actions = ("revoke_selected",)

    def get_queryset(self, request: HttpRequest) -> QuerySet[BoardApiToken]:
        queryset = admin.ModelAdmin.get_queryset(self, request)
        user: Any = request.user
        return queryset if user.is_superuser else queryset.filter(user=user)

    @admin.action(description="Revoke selected board tokens", permissions=["revoke"])
    def revoke_selected(self, request: HttpRequest, queryset: QuerySet[BoardApiToken]) -> None:
        ids = list(queryset.order_by("pk").values_list("pk", flat=True))
        self._revoke_each(request, ids, board_token_revoke, "token_id")

    def has_revoke_permission(self, request: HttpRequest) -> bool:
        return bool(getattr(request.user, "is_staff", False))


class IssueAdminForm(_ModelForm):
    class Meta:
        model = Issue
        fields = (
            "company",
            "title",
            "status",
            "hidden_at",
            "assignee_agent",
            "execution_workspace",
        )

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        company = data.get("company")
        for field in ("assignee_agent", "execution_workspace"):
            related = data.get(field)
            if related is not None and company is not None and related.company_id != company.pk:
                self.add_error(field, "Must belong to the issue's company.")
        return data


@admin.register(Issue)
class IssueAdmin(AuditedAdmin):
    form = IssueAdminForm
    audit_entity = "issue"
    list_display = (
        "title",
        "company",
        "status",
        "assignee_agent",
        "execution_run",
        "hidden_at",
        "updated_at",
    )
    list_filter = ("status", ("hidden_at", admin.EmptyFieldListFilter), COMPANY_FILTER)
    search_fields = ("title", "id")
    list_select_related = ("company", "assignee_agent")
    autocomplete_fields = ("company", "assignee_agent", "execution_workspace")
    # The execution lock moves only with run status changes (services).
    readonly_fields = (
        "id",
        "execution_run",
        "checkout_run",
        "execution_locked_at",
        "created_at",
        "updated_at",
    )


class ExecutionWorkspaceAdminForm(_ModelForm):
    class Meta:
        model = ExecutionWorkspace
        fields = (
            "company",
            "name",
            "status",
            "cwd",
            "source_issue",
            "mode",
            "strategy_type",
            "provider_type",
            "provider_ref",
            "metadata",
        )

    def clean_cwd(self) -> str | None:
        cwd = self.cleaned_data.get("cwd") or None
        if cwd is not None and (problem := absolute_path_error(cwd)):
            raise forms.ValidationError(problem)
        return cwd


@admin.register(ExecutionWorkspace)
class ExecutionWorkspaceAdmin(AuditedAdmin):
    form = ExecutionWorkspaceAdminForm
    audit_entity = "execution_workspace"
    list_display = ("name", "company", "status", "cwd", "runtime_lease_generation", "last_used_at")
    list_filter = ("status", ("provider_type", IndexedValuesListFilter), COMPANY_FILTER)
    search_fields = ("name", "id", "cwd")
    list_select_related = ("company",)
    autocomplete_fields = ("company", "source_issue")
    # The lease generation is a fencing counter owned by the lease service.
    readonly_fields = ("id", "runtime_lease_generation", "opened_at", "created_at", "updated_at")


@admin.register(ExecutionWorkspaceSnapshot)
class ExecutionWorkspaceSnapshotAdmin(ReadOnlyAdmin):
    list_display = ("id", "execution_workspace", "status", "created_at")
    list_filter = ("status",)
    search_fields = ("id", "execution_workspace__id")


class _FinalizeNowMixin:
    """ "Finalize now" (list action and detail button): `finalization_request`, as
    `POST /api/heartbeat-runs/{id}/finalize` does; audited `run.finalization_requested`."""

    def has_finalize_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.is_active and request.user.is_staff)

    def _finalize_each(self, request: HttpRequest, runs: list[tuple[Any, Any]]) -> None:
        model_admin: Any = self
        queued, unchanged, failed = 0, 0, []
        for company_id, run_id in runs:
            try:
                answer = finalization_request(
                    company_id=company_id,
                    run_id=run_id,
                    actor_type="user",
                    actor_id=str(request.user.pk),
                )
            except DomainError as exc:
                failed.append(f"{run_id}: {exc.code}")
                continue
            if answer.created:
                queued += 1
            else:
                unchanged += 1
        model_admin.message_user(
            request,
            f"Finalization queued for {queued}; already queued or committed {unchanged}; "
            f"failed: {', '.join(failed) or 'none'}",
            messages.WARNING if failed else messages.SUCCESS,
        )


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


@admin.register(HeartbeatRun)
class HeartbeatRunAdmin(_FinalizeNowMixin, ReadOnlyAdmin):
    list_display = (
        "id",
        "company",
        "agent",
        "issue",
        "status",
        "runtime_mode",
        "native_phase",
        "created_at",
        "finished_at",
    )
    list_filter = (
        "status",
        "runtime_mode",
        NativePhaseFilter,
        recent_filter("created_at", "created"),
        COMPANY_FILTER,
    )
    search_fields = ("=id", "agent__name", "issue__title", "=issue__id")
    list_select_related = ("company", "agent", "issue")
    actions = ("finalize_now",)
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

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return [
            "related_objects",
            *(f.name for f in HeartbeatRun._meta.fields),
        ]

    def timeline_run_id(self, obj: HeartbeatRun) -> Any:
        return obj.pk

    @admin.display(description="lease, actions, checkpoints, coordinator, operations, audit")
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
                {"run": obj, "related": related, "finalization": state},
            )
        )

    def detail_actions(self, request: HttpRequest, obj: HeartbeatRun) -> list[dict[str, Any]]:
        if obj.runtime_mode != HeartbeatRun.RuntimeMode.NATIVE:
            return []
        coordinator = NativeRunFinalization.objects.filter(run_id=obj.pk).first()
        if coordinator is None or coordinator.result_id is None or coordinator.phase == "committed":
            return []
        return [{"action": "finalize_now", "label": "Finalize now", "primary": True}]

    @admin.action(description="Finalize selected runs now", permissions=["finalize"])
    def finalize_now(self, request: HttpRequest, queryset: QuerySet[HeartbeatRun]) -> None:
        self._finalize_each(request, list(queryset.order_by("pk").values_list("company_id", "pk")))


class CoordinatorAttentionFilter(admin.SimpleListFilter):
    """The dashboard's finalization tiles (paperclip.selectors.attention builders)."""

    title = "needs attention"
    parameter_name = "attention"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [
            ("failed", "Failed (retries spent)"),
            ("retrying", "Retrying"),
            ("authority_expired", "Expired runner authority"),
        ]

    def queryset(
        self, request: HttpRequest, queryset: QuerySet[NativeRunFinalization]
    ) -> QuerySet[NativeRunFinalization]:
        if self.value() == "failed":
            return failed_finalizations(queryset)
        if self.value() == "retrying":
            return retrying_finalizations(queryset)
        if self.value() == "authority_expired":
            return expired_authority_coordinators(queryset)
        return queryset


@admin.register(NativeRunFinalization)
class NativeRunFinalizationAdmin(_FinalizeNowMixin, ReadOnlyAdmin):
    list_display = (
        "run_link",
        "company",
        "phase",
        "attempt",
        "controller_generation",
        "lease_expires_at",
        "failure_code",
        "next_attempt_at",
        "updated_at",
    )
    list_filter = (CoordinatorAttentionFilter, "phase", COMPANY_FILTER)
    search_fields = ("=run__id", "=issue__id", "lease_owner")
    list_select_related = ("company",)
    actions = ("finalize_now",)

    def timeline_entity_ids(self, obj: NativeRunFinalization) -> list[str]:
        return [str(obj.pk)]

    def timeline_run_id(self, obj: NativeRunFinalization) -> Any:
        return obj.pk

    @admin.display(description="run", ordering="run_id")
    def run_link(self, obj: NativeRunFinalization) -> SafeString | str:
        return admin_id_link(HeartbeatRun, obj.run_id)

    def detail_panels(self, request: HttpRequest, obj: NativeRunFinalization) -> list[SafeString]:
        run = HeartbeatRun.objects.filter(pk=obj.run_id, company_id=obj.company_id).first()
        if run is None or obj.result_id is None:
            return []
        state = finalization_state(run, coordinator=obj)
        words = {
            "failed": "Finalization failed: the copy-back retry budget is spent.",
            "retry_scheduled": "A copy-back attempt failed; the worker retries at the time below.",
            "held": "Held for the board: the previous owner can't be proven stopped.",
            "queued": "Queued: a worker will attempt it now.",
            "running": "Running: a live owner is finalizing it.",
            "waiting": "Due, but no job waits for it yet: the reconciler defers one shortly.",
            "committed": "Committed.",
        }
        lines = [f"Attempts: {state.attempts}."]
        if state.last_error:
            lines.append(f"Last error: {state.last_error}.")
        if state.next_attempt_at:
            lines.append(f"Next attempt: {state.next_attempt_at:%Y-%m-%d %H:%M:%S} UTC.")
        if state.state == "failed":
            lines.append(
                "Fix the cause (destination directory, permissions, disk on the worker's host), "
                "then retry finalization now."
            )
        if state.state == "held":
            lines.append("Open the run's recovery action and read its verdict.")
        return [
            console_panel(
                panel_id="finalization-state",
                state=state.state,
                title=f"Finalization: {state.state.replace('_', ' ')}",
                headline=words.get(state.state, state.state),
                lines=lines,
                ok=state.state in ("committed", "queued", "running"),
            )
        ]

    def detail_actions(
        self, request: HttpRequest, obj: NativeRunFinalization
    ) -> list[dict[str, Any]]:
        if obj.result_id is None or obj.phase == NativeRunFinalization.Phase.COMMITTED:
            return []
        label = "Retry finalization now" if obj.failure_code else "Finalize now"
        return [{"action": "finalize_now", "label": label, "primary": True}]

    @admin.action(description="Finalize selected runs now", permissions=["finalize"])
    def finalize_now(self, request: HttpRequest, queryset: QuerySet[NativeRunFinalization]) -> None:
        self._finalize_each(
            request, list(queryset.order_by("pk").values_list("company_id", "run_id"))
        )


@admin.register(NativeRunResult)
class NativeRunResultAdmin(ReadOnlyAdmin):
    list_display = (
        "id",
        "run",
        "schema_status",
        "rejection_code",
        "caller_result_id",
        "created_at",
    )
    list_filter = ("schema_status", COMPANY_FILTER)
    search_fields = ("id", "run__id", "caller_result_id", "server_fingerprint")


@admin.register(WorkspaceOperation)
class WorkspaceOperationAdmin(ReadOnlyAdmin):
    list_display = (
        "phase",
        "company",
        "status",
        "execution_workspace",
        "heartbeat_run",
        "lease_generation",
        "exit_code",
        "started_at",
        "finished_at",
    )
    list_filter = ("phase", "status", recent_filter("started_at", "started"), COMPANY_FILTER)
    search_fields = ("id", "heartbeat_run__id", "execution_workspace__id", "command")


@admin.register(ActivityEvent)
class ActivityEventAdmin(ReadOnlyAdmin):
    list_display = (
        "created",
        "company",
        "action",
        "actor_type",
        "actor_id",
        "entity_type",
        "entity",
    )
    list_select_related = ("company",)

    @admin.display(description="when (UTC)", ordering="created_at")
    def created(self, obj: ActivityEvent) -> SafeString | str:
        return stamp(obj.created_at)

    @admin.display(description="entity", ordering="entity_id")
    def entity(self, obj: ActivityEvent) -> SafeString | str:
        model = _ENTITY_MODELS.get(obj.entity_type)
        if model is None or parse_uuid(obj.entity_id) is None:
            return obj.entity_id
        return admin_id_link(model, obj.entity_id)

    # No date_hierarchy and no stock "all values" filters: their links read every row
    # (paperclip.admin_lists).
    list_filter = (
        ("action", IndexedValuesListFilter),
        "actor_type",
        ("entity_type", IndexedValuesListFilter),
        recent_filter("created_at", "when"),
        COMPANY_FILTER,
    )
    search_fields = ("entity_id", "actor_id")


# Audit rows' entity types whose id is the primary key of a console page (lease rows are named
# by their workspace, whose page links on to the lease).
_ENTITY_MODELS: dict[str, Any] = {
    "company": Company,
    "agent": Agent,
    "issue": Issue,
    "heartbeat_run": HeartbeatRun,
    "execution_workspace": ExecutionWorkspace,
    "native_run_finalization": NativeRunFinalization,
    "workspace_operation": WorkspaceOperation,
    "environment_lease": EnvironmentLease,
    "issue_recovery_action": IssueRecoveryAction,
}


# --- The worker (docs/worker.md#admin-pages) ------------------------------------------------
# Jobs are not company-scoped (their arguments name any company's runs), so these pages are for
# superusers only. They read; Procrastinate's own job actions (retry, cancel) stay available on
# the job list.


class _SuperuserReadOnly(admin.ModelAdmin):  # type: ignore[type-arg]
    def has_module_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.is_active and request.user.is_superuser)

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return self.has_module_permission(request)

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


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
