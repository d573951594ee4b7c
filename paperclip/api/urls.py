"""Core API routes (docs/api.md#core-endpoints), mounted under `api/`; no trailing slashes.

Path ids use Django's `uuid` converter, so a malformed id never reaches a view: it is a JSON
404 from `handler404`, like an id of another company.
"""

from django.urls import URLPattern, path

from paperclip.api import cas_views, history_views
from paperclip.api import core_views as views
from paperclip.api import schema as _schema  # noqa: F401  (registers auth extensions)

urlpatterns: list[URLPattern] = [
    path("me", views.MeApi.as_view(), name="me"),
    path("me/issues", views.MyIssuesApi.as_view(), name="my-issues"),
    path(
        "me/execution-workspaces",
        views.MyExecutionWorkspacesApi.as_view(),
        name="my-execution-workspaces",
    ),
    path("companies", views.CompanyCreateApi.as_view(), name="company-create"),
    path("companies/<uuid:company_id>/agents", views.AgentCreateApi.as_view(), name="agent-create"),
    path("agents/<uuid:agent_id>/keys", views.AgentKeyCreateApi.as_view(), name="agent-key-create"),
    path(
        "agent-keys/<uuid:key_id>/revoke",
        views.AgentKeyRevokeApi.as_view(),
        name="agent-key-revoke",
    ),
    path("companies/<uuid:company_id>/issues", views.IssueCreateApi.as_view(), name="issue-create"),
    path("issues/<uuid:issue_id>", views.IssueDetailApi.as_view(), name="issue-detail"),
    path(
        "companies/<uuid:company_id>/execution-workspaces",
        views.ExecutionWorkspaceCreateApi.as_view(),
        name="execution-workspace-create",
    ),
    path(
        "execution-workspaces/<uuid:workspace_id>",
        views.ExecutionWorkspaceGetApi.as_view(),
        name="execution-workspace-detail",
    ),
    path(
        "execution-workspaces/<uuid:workspace_id>/head",
        cas_views.ExecutionWorkspaceHeadApi.as_view(),
        name="execution-workspace-head",
    ),
    # A workspace's history (docs/snapshots.md#history).
    path(
        "execution-workspaces/<uuid:workspace_id>/history",
        history_views.WorkspaceHistoryApi.as_view(),
        name="execution-workspace-history",
    ),
    path(
        "execution-workspaces/<uuid:workspace_id>/diff",
        history_views.WorkspaceDiffApi.as_view(),
        name="execution-workspace-diff",
    ),
    path(
        "execution-workspaces/<uuid:workspace_id>/files",
        history_views.WorkspaceFilesApi.as_view(),
        name="execution-workspace-files",
    ),
    path(
        "execution-workspaces/<uuid:workspace_id>/restore",
        history_views.WorkspaceRestoreApi.as_view(),
        name="execution-workspace-restore",
    ),
    path("heartbeat-runs", views.RunCreateApi.as_view(), name="heartbeat-run-create"),
    path("heartbeat-runs/<uuid:run_id>", views.RunDetailApi.as_view(), name="heartbeat-run-detail"),
    path(
        "heartbeat-runs/<uuid:run_id>/interrupt",
        views.RunInterruptApi.as_view(),
        name="heartbeat-run-interrupt",
    ),
    # The content-addressed store (docs/snapshots.md#the-store); a bad blob name is a 400.
    path("cas", cas_views.CasLimitsApi.as_view(), name="cas-limits"),
    path("cas/find-missing", cas_views.CasFindMissingApi.as_view(), name="cas-find-missing"),
    path("cas/blobs/<str:name>", cas_views.CasBlobApi.as_view(), name="cas-blob"),
    path("cas/batch", cas_views.CasBatchApi.as_view(), name="cas-batch"),
    path("cas/batch-read", cas_views.CasBatchReadApi.as_view(), name="cas-batch-read"),
]
