"""HTTP API for recovery-source inspection (board)."""

from django.urls import URLPattern, path

from recovery.api.source_views import RecoverySourceInspectApi

urlpatterns: list[URLPattern] = [
    path(
        "issues/<uuid:issue_id>/recovery-actions/<uuid:action_id>/source",
        RecoverySourceInspectApi.as_view(),
        name="recovery-source-inspect",
    ),
]
