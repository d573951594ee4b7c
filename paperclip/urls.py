"""Root URL configuration: admin, health check, the API of every app and its docs."""

from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from paperclip.api.views import healthz, readyz
from paperclip.observability.views import metrics_view

urlpatterns = [
    # First: Django tries the patterns in order, and the runtime-lease claim (an agent's renew)
    # is the most frequent request. No other pattern overlaps these.
    path("api/", include("leases.api.urls")),
    path("admin/", admin.site.urls),
    path("healthz", healthz, name="healthz"),
    path("readyz", readyz, name="readyz"),
    path("metrics", metrics_view, name="metrics"),
    path("api/schema/", SpectacularAPIView.as_view(), name="api-schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="api-schema"), name="api-docs"),
    path("api/", include("paperclip.api.urls")),
    path("api/", include("leases.environment.api.urls")),
    path("api/", include("recovery.api.urls")),
    path("api/", include("recovery.api.source_urls")),
    path("api/", include("checkpoints.api.urls")),
]

handler400 = "paperclip.api.errors.json_bad_request"
handler404 = "paperclip.api.errors.json_not_found"
handler500 = "paperclip.api.errors.json_server_error"
