"""Read-only admin of checkpoint parts: names, sizes, key ids and times, never contents."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest
from django.utils.safestring import SafeString

from checkpoints.models import NativeRunnerCheckpoint
from paperclip.admin.toolkit import ReadOnlyAdmin, admin_id_link
from paperclip.models import HeartbeatRun, Issue


@admin.register(NativeRunnerCheckpoint)
class NativeRunnerCheckpointAdmin(ReadOnlyAdmin):
    """Rows are limited to the staff user's companies (superusers: all), like every board view;
    the company filter offers only companies that have visible parts."""

    list_display = (
        "part",
        "run_link",
        "issue_link",
        "company",
        "size_bytes",
        "key_id",
        "updated_at",
    )
    list_filter = (("company", admin.RelatedOnlyFieldListFilter),)
    search_fields = ("part", "=run__id", "=issue__id")
    list_select_related = ("company",)
    ordering = ("-updated_at",)
    # The sealed part (nonce, ciphertext) is deliberately absent from every view.
    fields = ("part", "run", "issue", "company", "size_bytes", "key_id", "created_at", "updated_at")
    readonly_fields = fields
    show_full_result_count = False

    def get_queryset(self, request: HttpRequest) -> Any:
        # Company-scoped by ReadOnlyAdmin. Never load the (possibly megabytes of) ciphertext
        # just to render a list.
        return super().get_queryset(request).defer("nonce", "ciphertext")

    @admin.display(description="run", ordering="run_id")
    def run_link(self, obj: NativeRunnerCheckpoint) -> SafeString | str:
        return admin_id_link(HeartbeatRun, obj.run_id)

    @admin.display(description="issue", ordering="issue_id")
    def issue_link(self, obj: NativeRunnerCheckpoint) -> SafeString | str:
        return admin_id_link(Issue, obj.issue_id)
