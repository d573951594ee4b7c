"""Admin of the worker stop receipts the platform recorded (read-only)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.safestring import SafeString

from paperclip.admin.names import run_link
from paperclip.admin.toolkit import member_company_ids
from recovery.models import WorkerStopReceipt

# Django's admin classes are not subscriptable at runtime (no django-stubs-ext patch).
if TYPE_CHECKING:
    _ReceiptAdmin = admin.ModelAdmin[WorkerStopReceipt]
else:
    _ReceiptAdmin = admin.ModelAdmin


@admin.register(WorkerStopReceipt)
class WorkerStopReceiptAdmin(_ReceiptAdmin):
    list_display = ("worker_id", "run_named", "owner_token", "stopped_at", "recorded_at")
    search_fields = ("worker_id", "owner_token", "=run__id", "run__agent__name")
    list_select_related = ("run__agent",)
    readonly_fields = (
        "company",
        "run_named",
        "owner_token",
        "worker_id",
        "stopped_at",
        "signature",
        "recorded_at",
    )

    def get_queryset(self, request: HttpRequest) -> QuerySet[WorkerStopReceipt]:
        qs = super().get_queryset(request).select_related(*self.list_select_related)
        company_ids = member_company_ids(request)
        return qs if company_ids is None else qs.filter(company_id__in=company_ids)

    @admin.display(description="run", ordering="run__agent__name")
    def run_named(self, obj: WorkerStopReceipt) -> SafeString | str:
        return run_link(obj.run)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
