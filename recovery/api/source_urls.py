"""HTTP API for recovery-source inspection (board)."""

from django.urls import URLPattern, path

from recovery.api.source_views import RecoverySourceInspectApi

urlpatterns: list[URLPattern] = [
    path(
        "issues/<str:issue_id>/recovery-actions/<str:action_id>/source",
        RecoverySourceInspectApi.as_view(),
        name="recovery-source-inspect",
    ),
]
