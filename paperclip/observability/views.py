"""`GET /metrics` (docs/operations.md#metrics)."""

from __future__ import annotations

import hmac
import os

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_GET
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest, multiprocess
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from paperclip.api.errors import error_body, json_not_found
from paperclip.observability.metrics import scrape_collectors


def _authorized(request: HttpRequest) -> bool:
    token = settings.PAPERCLIP_METRICS_TOKEN
    if not token:
        return True
    scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        presented.strip().encode(), token.encode()
    )


@require_GET
def metrics_view(request: HttpRequest) -> HttpResponse:
    """The Prometheus text format: this host's processes' counters and histograms (summed over
    PAPERCLIP_METRICS_DIR), then the gauges read from the database now (the stuck work). 404 unless
    PAPERCLIP_METRICS_ENABLED; with PAPERCLIP_METRICS_TOKEN set, 401 without that bearer."""
    if not settings.PAPERCLIP_METRICS_ENABLED:
        return json_not_found(request)  # as for any unknown path
    if not _authorized(request):
        response = JsonResponse(
            error_body(
                "not_authenticated",
                "The metrics endpoint needs the bearer token of PAPERCLIP_METRICS_TOKEN.",
            ),
            status=401,
        )
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
        processes = CollectorRegistry()
        multiprocess.MultiProcessCollector(processes)  # type: ignore[no-untyped-call]
    else:  # the only process there is (metrics enabled after start-up, as in tests)
        processes = REGISTRY
    read_now = CollectorRegistry(auto_describe=False)
    for collector in scrape_collectors():
        read_now.register(collector)
    body = generate_latest(processes) + generate_latest(read_now)
    return HttpResponse(body, content_type=CONTENT_TYPE_LATEST)
