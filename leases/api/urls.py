"""HTTP API of the leases app: runtime leases and lease-fenced workspace operations."""

from django.urls import URLPattern, path

from leases.api.batch import LeasesRenewApi
from leases.api.lean import runtime_lease_claim_view
from leases.api.views import (
    RunSnapshotRegisterApi,
    RuntimeLeaseDetailApi,
    RuntimeLeaseReleaseApi,
    WorkspaceOperationCreateApi,
)

urlpatterns: list[URLPattern] = [
    path("leases/renew", LeasesRenewApi.as_view(), name="leases-renew"),
    path(
        "execution-workspaces/<uuid:workspace_id>/runtime-lease",
        RuntimeLeaseDetailApi.as_view(),
        name="runtime-lease-detail",
    ),
    path(
        "execution-workspaces/<uuid:workspace_id>/runtime-lease/claim",
        runtime_lease_claim_view,  # the DRF view for all but plain agent requests
        name="runtime-lease-claim",
    ),
    path(
        "execution-workspaces/<uuid:workspace_id>/runtime-lease/release",
        RuntimeLeaseReleaseApi.as_view(),
        name="runtime-lease-release",
    ),
    path(
        "execution-workspaces/<uuid:workspace_id>/operations",
        WorkspaceOperationCreateApi.as_view(),
        name="workspace-operation-create",
    ),
    path(
        "heartbeat-runs/<uuid:run_id>/snapshots",
        RunSnapshotRegisterApi.as_view(),
        name="run-snapshot-register",
    ),
]
