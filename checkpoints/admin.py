"""Read-only admin of checkpoint parts: names, sizes, key ids and times, never contents."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.contrib import admin
from django.db.models.fields.json import KT
from django.http import HttpRequest

from checkpoints.models import NativeRunnerCheckpoint

if TYPE_CHECKING:
    _ModelAdmin = admin.ModelAdmin[NativeRunnerCheckpoint]
else:  # ModelAdmin is not subscriptable at runtime (no django_stubs_ext monkeypatch here)
    _ModelAdmin = admin.ModelAdmin


@admin.register(NativeRunnerCheckpoint)
class NativeRunnerCheckpointAdmin(_ModelAdmin):
    list_display = ("part", "run_id", "issue_id", "company", "size_bytes", "key_id", "updated_at")
    list_filter = ("company",)
    search_fields = ("part", "=run__id", "=issue__id")
    list_select_related = ("company",)
    ordering = ("-updated_at",)
    # `material` (the ciphertext envelope) is deliberately absent from every view.
    fields = ("part", "run", "issue", "company", "size_bytes", "key_id", "created_at", "updated_at")
    readonly_fields = fields
    show_full_result_count = False

    def get_queryset(self, request: HttpRequest) -> Any:
        # Never load the (possibly megabytes of) ciphertext just to render a list.
        return (
            super()
            .get_queryset(request)
            .defer("material")
            .annotate(material_key_id=KT("material__keyId"))
        )

    @admin.display(description="key id", ordering="material_key_id")
    def key_id(self, obj: NativeRunnerCheckpoint) -> str:
        return getattr(obj, "material_key_id", None) or "-"

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
