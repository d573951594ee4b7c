"""Admin for environment leases and environments (found by Django's admin autodiscovery:
`leases.environment` is an installed app).

Environment leases are state-bearing (cleanup claims, stop-only intents): read-only here, so
no change form can bypass the cleanup protocol's guards. Environments are editable setup
records: every admin save writes an audit row, and they are archived (status), never deleted
here, because deleting one would strand its leases' allocations. Staff users who are not
superusers see only their companies' rows (environments without a company, the instance-scoped
variant, only superusers). "Retry cleanup of all N matching…" runs the retry on every lease
the list's filter matches (paperclip.admin.bulk).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from uuid import UUID

from django import forms
from django.contrib import admin
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils.html import format_html
from django.utils.safestring import SafeString

from leases.environment.attention import cleanup_attention, failed_cleanups
from leases.environment.export_resume.keys import STOP_ONLY_KEYS, STOP_ONLY_READ_FIELDS
from leases.environment.export_resume.markers import (
    export_resume_has,
    export_resume_problem,
    export_resume_read,
    stop_only_cleanup_has,
    stop_only_cleanup_problem,
)
from leases.environment.lifecycle import environment_lease_force_release
from leases.environment.services import environment_lease_cleanup_retry_now
from leases.models import EnvironmentLease
from paperclip.access import Actor, board_actor
from paperclip.admin.bulk import BulkAction, BulkByFilterMixin
from paperclip.admin.names import run_link
from paperclip.admin.toolkit import (
    COMPANY_FILTER,
    AuditedAdmin,
    ReadOnlyAdmin,
    act_on_each,
    console_panel,
    report_each,
    short_id,
)
from paperclip.models import Environment
from paperclip.templatetags.console import age

RETRY_CLEANUP_TEMPLATE = "admin/leases/environmentlease/retry_cleanup_confirmation.html"
FORCE_RELEASE_TEMPLATE = "admin/leases/environmentlease/force_release_confirmation.html"


class ReasonForm(forms.Form):
    reason = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 3, "cols": 80}),
        max_length=2000,
        strip=True,
        help_text="Why (for example: the provider's outage is over, or its agent is gone); "
        "kept in each lease's audit row.",
    )


def _retry_cleanup_one(actor: Actor, lease: EnvironmentLease, reason: str) -> str:
    answer = environment_lease_cleanup_retry_now(
        company_ids=actor.company_ids,
        lease_id=lease.pk,
        actor_type=actor.actor_type,
        actor_id=actor.actor_id,
        reason=reason,
    )
    return "reopened" if answer.reopened else "already_pending"


RETRY_CLEANUP_BULK = BulkAction(
    slug="retry-cleanup",
    action="retry_cleanup_now",
    verb="Retry cleanup of",
    title="Retry the cleanup of every matching environment lease now",
    act=_retry_cleanup_one,
    outcomes={
        "reopened": "reopened (the provider's next claim takes each; the outcome shows in "
        "each lease's cleanup status)",
        "already_pending": "already pending with no back-off (nothing written)",
    },
    name=lambda lease: f"lease {lease.pk}",
    explanation="Retrying reopens each failed or backing-off cleanup at once, as the retry "
    "sweep does when the back-off is over. A lease that is not pending cleanup, or whose "
    "cleanup a provider holds right now, is refused and left as it is.",
    reason_help="Why (for example: the provider's outage is over); kept in each lease's audit row.",
    columns=(
        ("Provider", lambda lease: lease.provider),
        ("Status", lambda lease: lease.status),
        ("Cleanup", lambda lease: lease.cleanup_status),
    ),
)


class StopOnlyFilter(admin.SimpleListFilter):
    """Stop-only intents that do not bind to their lease are never cleaned up automatically;
    this finds them (the dashboard's "invalid stop-only marker" tile links here)."""

    title = "stop-only marker"
    parameter_name = "stop_only"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("invalid", "Invalid (operator must inspect)"), ("any", "Present")]

    def queryset(
        self, request: HttpRequest, queryset: QuerySet[EnvironmentLease]
    ) -> QuerySet[EnvironmentLease]:
        if self.value() == "invalid":
            # Validity is the Python reader's verdict; scan only rows that carry an intent.
            candidates = queryset.filter(metadata__has_any_keys=list(STOP_ONLY_KEYS)).only(
                *STOP_ONLY_READ_FIELDS
            )
            ids = [lease.pk for lease in candidates if stop_only_cleanup_problem(lease)]
            return queryset.filter(pk__in=ids)
        if self.value() == "any":
            return queryset.filter(metadata__has_any_keys=list(STOP_ONLY_KEYS))
        return queryset


class CleanupAttentionFilter(admin.SimpleListFilter):
    """The dashboard's cleanup tiles (leases.environment.attention builders)."""

    title = "needs attention"
    parameter_name = "attention"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("cleanup_failed", "Cleanup failed"), ("claim_overdue", "Claimed too long")]

    def queryset(
        self, request: HttpRequest, queryset: QuerySet[EnvironmentLease]
    ) -> QuerySet[EnvironmentLease]:
        if self.value() == "cleanup_failed":
            return failed_cleanups(queryset)
        if self.value() == "claim_overdue":
            ids = [pk for pk, _ in cleanup_attention(queryset)["claim_overdue"]]
            return queryset.filter(pk__in=ids)
        return queryset


class EnvironmentLeaseAdmin(BulkByFilterMixin, ReadOnlyAdmin):
    # Fits a 1366 px screen: the policy and the stop-only flag are filters (and on the page);
    # the marker column says whether a stop-only marker is there and valid.
    list_display = (
        "lease",
        "company",
        "run",
        "allocation",
        "status",
        "cleanup_status",
        "failure",
        "marker_state",
        "cleanup_claim",
        "released",
    )
    list_filter = (
        CleanupAttentionFilter,
        StopOnlyFilter,
        "status",
        "lease_policy",
        "cleanup_status",
        "provider",
        COMPANY_FILTER,
    )
    search_fields = ("=id", "=provider_lease_id", "=heartbeat_run__id")
    list_select_related = ("company", "heartbeat_run__agent")
    list_display_links = ("lease",)
    ordering = ("-last_used_at",)
    readonly_fields = (
        "id",
        "company",
        "environment",
        "execution_workspace",
        "issue",
        "run",
        "status",
        "lease_policy",
        "provider",
        "provider_lease_id",
        "acquired_at",
        "last_used_at",
        "expires_at",
        "released_at",
        "failure_reason",
        "cleanup_status",
        "export_resume_marker",
        "stop_only_check",
        "metadata",
    )
    fields = readonly_fields
    actions = ("retry_cleanup_now", "force_release")
    bulk_actions = (RETRY_CLEANUP_BULK,)

    def detail_actions(self, request: HttpRequest, obj: EnvironmentLease) -> list[dict[str, Any]]:
        if obj.status == EnvironmentLease.Status.ACTIVE:
            return [{"action": "force_release", "label": "Force release…", "primary": False}]
        # Offered where a retry would change something: a failed cleanup, or one whose
        # back-off is set (the sweep clears it when due); a plain pending one waits for a claim.
        metadata = obj.metadata if isinstance(obj.metadata, dict) else {}
        retry_after = metadata.get("pendingCleanupRetryAfterMs")
        failed = obj.cleanup_status == EnvironmentLease.CleanupStatus.FAILED
        backing_off = isinstance(retry_after, int) and retry_after > 0
        if obj.status != EnvironmentLease.Status.PENDING_CLEANUP or not (failed or backing_off):
            return []
        return [{"action": "retry_cleanup_now", "label": "Retry cleanup now…", "primary": True}]

    def has_retry_cleanup_permission(self, request: HttpRequest) -> bool:
        user: Any = request.user
        return bool(
            user.is_active and user.is_staff and user.has_perm("leases.change_environmentlease")
        )

    @admin.action(
        description="Retry cleanup of selected leases now (reason required)",
        permissions=["retry_cleanup"],
    )
    def retry_cleanup_now(
        self, request: HttpRequest, queryset: QuerySet[EnvironmentLease]
    ) -> HttpResponse | None:
        return self._confirm_with_reason(
            request,
            list(queryset.order_by("pk")),
            title="Retry environment cleanups now",
            action_name="retry_cleanup_now",
            template=RETRY_CLEANUP_TEMPLATE,
            apply=self._retry_each,
        )

    def _confirm_with_reason(
        self,
        request: HttpRequest,
        leases: list[EnvironmentLease],
        *,
        title: str,
        action_name: str,
        template: str,
        apply: Callable[[HttpRequest, list[UUID], str], None],
    ) -> HttpResponse | None:
        """The action's confirmation page (the selected leases and a required reason), or,
        once confirmed, `apply` to each of them (None: back to the list with its message)."""
        form = ReasonForm(request.POST if "apply" in request.POST else None)
        if form.is_bound and form.is_valid():
            apply(request, [lease.pk for lease in leases], form.cleaned_data["reason"])
            return None
        context = {
            **self.admin_site.each_context(request),
            "title": title,
            "opts": self.model._meta,
            "leases": leases,
            "form": form,
            "action_checkbox_name": ACTION_CHECKBOX_NAME,
            "action_name": action_name,
        }
        return TemplateResponse(request, template, context)

    def _retry_each(self, request: HttpRequest, lease_ids: list[UUID], reason: str) -> None:
        actor = board_actor(request.user)

        def act(lease_id: UUID) -> str:
            answer = environment_lease_cleanup_retry_now(
                company_ids=actor.company_ids,
                lease_id=lease_id,
                actor_type=actor.actor_type,
                actor_id=actor.actor_id,
                reason=reason,
            )
            return "reopened" if answer.reopened else "already_pending"

        done = act_on_each(lease_ids, act, name=lambda lease_id: f"lease {lease_id}")
        report_each(
            self,
            request,
            f"Cleanup reopened for {done.counts['reopened']} lease(s): the provider's next "
            "claim takes it; the outcome will show in each lease's cleanup status on its page. "
            f"Already pending: {done.counts['already_pending']}. Refused: ",
            done.failed,
        )

    def has_force_release_permission(self, request: HttpRequest) -> bool:
        return self.has_retry_cleanup_permission(request)

    @admin.action(
        description="Force release selected leases as failed (reason required)",
        permissions=["force_release"],
    )
    def force_release(
        self, request: HttpRequest, queryset: QuerySet[EnvironmentLease]
    ) -> HttpResponse | None:
        return self._confirm_with_reason(
            request,
            list(queryset.select_related("heartbeat_run").order_by("pk")),
            title="Force release environment leases",
            action_name="force_release",
            template=FORCE_RELEASE_TEMPLATE,
            apply=self._force_each,
        )

    def _force_each(self, request: HttpRequest, lease_ids: list[UUID], reason: str) -> None:
        actor = board_actor(request.user)

        def act(lease_id: UUID) -> str:
            answer = environment_lease_force_release(
                company_ids=actor.company_ids,
                lease_id=lease_id,
                actor_type=actor.actor_type,
                actor_id=actor.actor_id,
                reason=reason,
            )
            return answer.lease.status if answer.released else "not_active"

        done = act_on_each(lease_ids, act, name=lambda lease_id: f"lease {lease_id}")
        now = ", ".join(
            f"{count} {status}"
            for status, count in sorted(done.counts.items())
            if status != "not_active"
        )
        report_each(
            self,
            request,
            f"Force-released {done.counts.total() - done.counts['not_active']} lease(s) as "
            f"failed, each where its policy and export marker put it (now: {now or 'none'}); "
            "a pending cleanup is taken by the provider's next claim and its outcome will show "
            "in the lease's cleanup status on its page. Already not active, nothing written: "
            f"{done.counts['not_active']}. Refused: ",
            done.failed,
        )

    def detail_panels(self, request: HttpRequest, obj: EnvironmentLease) -> list[SafeString]:
        panels: list[SafeString] = []
        problem = stop_only_cleanup_problem(obj)
        if problem is not None:
            panels.append(
                console_panel(
                    panel_id="marker-verdict",
                    state="marker_invalid",
                    title="Cleanup blocked: invalid stop-only marker",
                    headline=f"The check that failed: {problem}.",
                    lines=(
                        "This lease is never cleaned up automatically: the allocation may hold "
                        "unexported work.",
                        "Inspect the metadata below against the lease's company, run, id, "
                        "provider and allocation, and the provider's own record.",
                    ),
                )
            )
        if failed_cleanups(EnvironmentLease.objects.filter(pk=obj.pk)).exists():
            panels.append(
                console_panel(
                    panel_id="cleanup-verdict",
                    state="cleanup_failed",
                    title="Cleanup failed",
                    headline="The last cleanup receipt did not settle; retried with back-off.",
                    lines=("Check the provider if the attempts keep growing.",),
                )
            )
        this = EnvironmentLease.objects.filter(pk=obj.pk)
        if cleanup_attention(this)["claim_overdue"]:
            panels.append(
                console_panel(
                    panel_id="claim-verdict",
                    state="claim_overdue",
                    title="Cleanup claimed too long",
                    headline="A provider worker claimed this cleanup and its claim expired "
                    "without a receipt; the next claim takes it over.",
                )
            )
        return panels

    @admin.display(description="lease", ordering="id")
    def lease(self, lease: EnvironmentLease) -> SafeString:
        return format_html('<code title="{}">{}</code>', lease.pk, short_id(lease.pk))

    @admin.display(description="run")
    def run(self, lease: EnvironmentLease) -> SafeString | str:
        return run_link(lease.heartbeat_run)

    @admin.display(description="allocation", ordering="provider_lease_id")
    def allocation(self, lease: EnvironmentLease) -> SafeString:
        return _cut(f"{lease.provider}:{lease.provider_lease_id or '—'}", 24, code=True)

    @admin.display(description="failure", ordering="failure_reason")
    def failure(self, lease: EnvironmentLease) -> SafeString | str:
        return _cut(lease.failure_reason, 24) if lease.failure_reason else "—"

    @admin.display(description="released (UTC)", ordering="released_at")
    def released(self, lease: EnvironmentLease) -> SafeString | str:
        if lease.released_at is None:
            return "—"
        return format_html(
            '<span title="{}">{}</span>', lease.released_at.isoformat(), age(lease.released_at)
        )

    def detail_title(self, obj: EnvironmentLease) -> str:
        run = f", run {short_id(obj.heartbeat_run_id)}" if obj.heartbeat_run_id else ""
        return f"{obj.provider} lease {short_id(obj.pk)} ({obj.status}{run})"

    @admin.display(description="marker")
    def marker_state(self, lease: EnvironmentLease) -> SafeString | str:
        if not stop_only_cleanup_has(lease):
            return "—"
        problem = stop_only_cleanup_problem(lease)
        if problem is None:
            return "valid"
        return format_html('<strong class="console-late" title="{}">INVALID</strong>', problem)

    @admin.display(description="stop-only check")
    def stop_only_check(self, lease: EnvironmentLease) -> SafeString | str:
        if not stop_only_cleanup_has(lease):
            return "no stop-only intent"
        problem = stop_only_cleanup_problem(lease)
        if problem is None:
            return "valid: cleanup may only stop this allocation, never destroy it"
        return format_html(
            '<p class="errornote">Invalid, never cleaned up automatically: {}. Inspect the '
            "metadata: the allocation may hold unexported work.</p>",
            problem,
        )

    @admin.display(description="stop only", boolean=True)
    def stop_only(self, lease: EnvironmentLease) -> bool:
        return stop_only_cleanup_has(lease)

    @admin.display(description="cleanup claim")
    def cleanup_claim(self, lease: EnvironmentLease) -> SafeString | str:
        metadata = lease.metadata if isinstance(lease.metadata, dict) else {}
        if metadata.get("pendingCleanupInFlight") is True:
            return _cut(f"in flight: {metadata.get('pendingCleanupAttemptId')}", 20)
        return "-"

    @admin.display(description="export-resume marker")
    def export_resume_marker(self, lease: EnvironmentLease) -> str:
        if not export_resume_has(lease):
            return "none"
        marker = export_resume_read(lease)
        if marker is None:
            return f"INVALID: {export_resume_problem(lease)} (never cleaned up automatically)"
        return f"{marker.schema} request {marker.request_id} result {marker.result_id}"


def _cut(text: str, limit: int, *, code: bool = False) -> SafeString:
    """`text` cut at `limit` characters, the whole of it in the title attribute."""
    shown = text if len(text) <= limit else f"{text[: limit - 1]}…"
    if code:
        return format_html('<code title="{}">{}</code>', text, shown)
    return format_html('<span title="{}">{}</span>', text, shown)


class EnvironmentAdmin(AuditedAdmin):
    audit_entity = "environment"
    list_display = ("name", "company", "driver", "status", "created_at")
    list_filter = ("driver", "status")
    search_fields = ("name", "=id")
    readonly_fields = ("id", "created_at", "updated_at")

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # archive instead: a deleted environment strands its leases


# Guarded: Environment is a `paperclip` model and may be registered there instead.
if not admin.site.is_registered(EnvironmentLease):
    admin.site.register(EnvironmentLease, EnvironmentLeaseAdmin)
if not admin.site.is_registered(Environment):
    admin.site.register(Environment, EnvironmentAdmin)
