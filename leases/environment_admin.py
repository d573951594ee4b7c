"""Admin for environment leases and environments (registered from leases/admin.py).

Environment leases are state-bearing (cleanup claims, stop-only intents): read-only here, so
no change form can bypass the cleanup protocol's guards.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.contrib import admin
from django.http import HttpRequest

from leases.export_resume import export_resume_has, export_resume_read, stop_only_cleanup_has
from leases.models import EnvironmentLease
from paperclip.models import Environment

if TYPE_CHECKING:
    _ModelAdmin = admin.ModelAdmin[Any]
else:  # ModelAdmin is not subscriptable at runtime (django-stubs-ext is not installed)
    _ModelAdmin = admin.ModelAdmin


class _ReadOnlyAdmin(_ModelAdmin):
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class EnvironmentLeaseAdmin(_ReadOnlyAdmin):
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
        "cleanup_claim",
        "released_at",
    )
    list_filter = ("status", "lease_policy", "cleanup_status", "provider")
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
        "metadata",
    )
    fields = readonly_fields

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
            return "INVALID: does not bind to this lease (never cleaned up automatically)"
        return f"{marker.schema} request {marker.request_id} result {marker.result_id}"


class EnvironmentAdmin(_ModelAdmin):
    list_display = ("name", "company", "driver", "status", "created_at")
    list_filter = ("driver", "status")
    search_fields = ("name", "=id")
    readonly_fields = ("id", "created_at", "updated_at")


# Guarded: Environment is a `paperclip` model and may be registered there instead.
if not admin.site.is_registered(EnvironmentLease):
    admin.site.register(EnvironmentLease, EnvironmentLeaseAdmin)
if not admin.site.is_registered(Environment):
    admin.site.register(Environment, EnvironmentAdmin)
