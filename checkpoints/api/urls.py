"""HTTP API of the checkpoints app (mounted under `api/`)."""

from django.urls import URLPattern, path

from checkpoints.api import views

urlpatterns: list[URLPattern] = [
    path(
        "heartbeat-runs/<uuid:run_id>/controller-lease",
        views.ControllerLeaseAcquireApi.as_view(),
        name="controller-lease-acquire",
    ),
    path(
        "heartbeat-runs/<uuid:run_id>/controller-lease/expire",
        views.ControllerLeaseExpireApi.as_view(),
        name="controller-lease-expire",
    ),
    path(
        "heartbeat-runs/<uuid:run_id>/checkpoint",
        views.CheckpointApi.as_view(),
        name="checkpoint",
    ),
    path(
        "heartbeat-runs/<uuid:run_id>/checkpoint/header",
        views.CheckpointHeaderApi.as_view(),
        name="checkpoint-header",
    ),
    path(
        "heartbeat-runs/<uuid:run_id>/checkpoint/parts",
        views.CheckpointPartsListApi.as_view(),
        name="checkpoint-parts",
    ),
]
