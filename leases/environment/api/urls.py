"""HTTP API for environment leases (provider cleanup protocol)."""

from django.urls import URLPattern, path

from leases.environment.api.views import (
    EnvironmentLeaseCleanupClaimApi,
    EnvironmentLeaseCleanupReceiptApi,
)

urlpatterns: list[URLPattern] = [
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
