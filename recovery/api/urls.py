"""HTTP API of the recovery app."""

from django.urls import URLPattern, path

from recovery.api.views import (
    IssueRecoveryActionListApi,
    OwnerStopConfirmApi,
    RunFinalizeApi,
    RunResultAcceptApi,
    WorkerStopRecordApi,
    WorkspaceConflictPreviewApi,
    WorkspaceConflictResolveApi,
    WorkspaceExportRetryApi,
)

urlpatterns: list[URLPattern] = [
    path(
        "heartbeat-runs/<uuid:run_id>/results",
        RunResultAcceptApi.as_view(),
        name="run-result-accept",
    ),
    path(
        "heartbeat-runs/<uuid:run_id>/finalize",
        RunFinalizeApi.as_view(),
        name="run-finalize",
    ),
    path(
        "issues/<uuid:issue_id>/recovery-actions",
        IssueRecoveryActionListApi.as_view(),
        name="issue-recovery-actions",
    ),
    path(
        "issues/<uuid:issue_id>/recovery-actions/resume-workspace-finalization",
        OwnerStopConfirmApi.as_view(),
        name="issue-recovery-resume-workspace-finalization",
    ),
    path(
        "issues/<uuid:issue_id>/recovery-actions/resolve-workspace-conflict",
        WorkspaceConflictResolveApi.as_view(),
        name="issue-recovery-resolve-workspace-conflict",
    ),
    path(
        "issues/<uuid:issue_id>/recovery-actions/<uuid:action_id>/conflict",
        WorkspaceConflictPreviewApi.as_view(),
        name="issue-recovery-workspace-conflict-preview",
    ),
    path(
        "issues/<uuid:issue_id>/recovery-actions/retry-workspace-export",
        WorkspaceExportRetryApi.as_view(),
        name="issue-recovery-retry-workspace-export",
    ),
    path("platform/worker-stops", WorkerStopRecordApi.as_view(), name="platform-worker-stops"),
]
