"""HTTP API for environment leases: environments, the lease lifecycle, the cleanup protocol."""

from django.urls import URLPattern, path

from leases.environment.api.views import (
    EnvironmentCreateApi,
    EnvironmentLeaseAcquireApi,
    EnvironmentLeaseCleanupClaimApi,
    EnvironmentLeaseCleanupReceiptApi,
    EnvironmentLeaseDetailApi,
    EnvironmentLeaseHeartbeatApi,
    EnvironmentLeaseListApi,
    EnvironmentLeaseReleaseApi,
)

urlpatterns: list[URLPattern] = [
    path(
        "companies/<uuid:company_id>/environments",
        EnvironmentCreateApi.as_view(),
        name="environment-create",
    ),
    path(
        "companies/<uuid:company_id>/environment-leases",
        EnvironmentLeaseListApi.as_view(),
        name="environment-lease-list",
    ),
    path(
        "environment-leases", EnvironmentLeaseAcquireApi.as_view(), name="environment-lease-acquire"
    ),
    path(
        "environment-leases/<uuid:lease_id>",
        EnvironmentLeaseDetailApi.as_view(),
        name="environment-lease-detail",
    ),
    path(
        "environment-leases/<uuid:lease_id>/heartbeat",
        EnvironmentLeaseHeartbeatApi.as_view(),
        name="environment-lease-heartbeat",
    ),
    path(
        "environment-leases/<uuid:lease_id>/release",
        EnvironmentLeaseReleaseApi.as_view(),
        name="environment-lease-release",
    ),
    path(
        "environment-leases/<uuid:lease_id>/cleanup-claims",
        EnvironmentLeaseCleanupClaimApi.as_view(),
        name="environment-lease-cleanup-claim",
    ),
    path(
        "environment-leases/<uuid:lease_id>/cleanup-receipts",
        EnvironmentLeaseCleanupReceiptApi.as_view(),
        name="environment-lease-cleanup-receipt",
    ),
]
