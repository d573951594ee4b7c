"""Admin for environment leases and environments (found by Django's admin autodiscovery:
`leases.environment` is an installed app).

Environment leases are state-bearing (cleanup claims, stop-only intents): read-only here, so
no change form can bypass the cleanup protocol's guards. Environments are editable setup
records: every admin save writes an audit row, and they are archived (status), never deleted
here, because deleting one would strand its leases' allocations. Staff users who are not
superusers see only their companies' rows (environments without a company, the instance-scoped
variant, only superusers).
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.html import format_html
from django.utils.safestring import SafeString

from leases.environment.attention import cleanup_attention, failed_cleanups
from leases.environment.export_resume import (
    STOP_ONLY_KEYS,
    STOP_ONLY_READ_FIELDS,
    export_resume_has,
    export_resume_problem,
    export_resume_read,
    stop_only_cleanup_has,
    stop_only_cleanup_problem,
)
from leases.models import EnvironmentLease
from paperclip.admin.toolkit import COMPANY_FILTER, AuditedAdmin, ReadOnlyAdmin, console_panel
from paperclip.models import Environment


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


class EnvironmentLeaseAdmin(ReadOnlyAdmin):
    list_display = (
        "id",
        "company",
        "provider",
        "provider_lease_id",
        "status",
        "lease_policy",
        "cleanup_status",
        "failure_reason",
        "stop_only",
        "marker_state",
        "cleanup_claim",
        "released_at",
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
    list_select_related = ("company",)
    ordering = ("-last_used_at",)
    readonly_fields = (
        "id",
        "company",
        "environment",
        "execution_workspace",
        "issue",
        "heartbeat_run",
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

    @admin.display(description="marker")
    def marker_state(self, lease: EnvironmentLease) -> SafeString | str:
        if not stop_only_cleanup_has(lease):
            return "—"
        problem = stop_only_cleanup_problem(lease)
        if problem is None:
            return "valid"
        return format_html('<strong class="errornote" title="{}">INVALID</strong>', problem)

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
    def cleanup_claim(self, lease: EnvironmentLease) -> str:
        metadata = lease.metadata if isinstance(lease.metadata, dict) else {}
        if metadata.get("pendingCleanupInFlight") is True:
            return f"in flight: {metadata.get('pendingCleanupAttemptId')}"
        return "-"

    @admin.display(description="export-resume marker")
    def export_resume_marker(self, lease: EnvironmentLease) -> str:
        if not export_resume_has(lease):
            return "none"
        marker = export_resume_read(lease)
        if marker is None:
            return f"INVALID: {export_resume_problem(lease)} (never cleaned up automatically)"
        return f"{marker.schema} request {marker.request_id} result {marker.result_id}"


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
