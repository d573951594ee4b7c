"""Read-only admin of checkpoint parts: names, sizes, key ids and times, never contents."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from checkpoints.models import NativeRunnerCheckpoint
from paperclip.admin.names import RunIssueColumns, run_name
from paperclip.admin.toolkit import ReadOnlyAdmin, short_id


@admin.register(NativeRunnerCheckpoint)
class NativeRunnerCheckpointAdmin(RunIssueColumns, ReadOnlyAdmin):
    """Rows are limited to the staff user's companies (superusers: all), like every board view;
    the company filter offers only companies that have visible parts."""

    list_display = (
        "part",
        "run_named",
        "issue_named",
        "company",
        "size_bytes",
        "key_id",
        "updated_at",
    )
    list_filter = (("company", admin.RelatedOnlyFieldListFilter),)
    search_fields = ("part", "=run__id", "=issue__id", "run__agent__name", "issue__title")
    list_select_related = ("company", "run__agent", "issue")
    ordering = ("-updated_at",)
    # The sealed part (nonce, ciphertext) is deliberately absent from every view.
    fields = (
        "part",
        "run_named",
        "issue_named",
        "company",
        "size_bytes",
        "key_id",
        "created_at",
        "updated_at",
    )
    readonly_fields = fields
    show_full_result_count = False

    def get_queryset(self, request: HttpRequest) -> Any:
        # Company-scoped by ReadOnlyAdmin. Never load the (possibly megabytes of) ciphertext
        # just to render a list.
        # The change page names the run's agent and the issue too.
        return (
            super()
            .get_queryset(request)
            .select_related(*self.list_select_related)
            .defer("nonce", "ciphertext")
        )

    def detail_title(self, obj: NativeRunnerCheckpoint) -> str:
        return f"{obj.part} of {run_name(obj.run)} ({short_id(obj.run_id)}) on “{obj.issue.title}”"
