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
from django.http import HttpRequest

from leases.environment.export_resume import (
    export_resume_has,
    export_resume_read,
    stop_only_cleanup_has,
)
from leases.models import EnvironmentLease
from paperclip.admin import AuditedAdmin, ReadOnlyAdmin
from paperclip.models import Environment


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
