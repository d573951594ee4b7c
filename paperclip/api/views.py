"""Core API views live in paperclip/api/core_views.py; this module keeps the health checks."""

from __future__ import annotations

from django.db import connection
from django.http import HttpRequest, JsonResponse

from paperclip.worker.health import readiness


def healthz(request: HttpRequest) -> JsonResponse:
    """200 when the database answers; 503 otherwise."""
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    except Exception:
        return JsonResponse({"status": "unavailable", "database": "down"}, status=503)
    return JsonResponse({"status": "ok", "database": "ok"})


def readyz(request: HttpRequest) -> JsonResponse:
    """200 `{"database": "ok", "migrations": "ok", "worker": "ok"}` when this process can serve
    and some worker heartbeat is fresh; 503 with the failing part otherwise (`down`, `pending`,
    `stale`; docs/worker.md#readiness)."""
    report = readiness()
    ready = all(value == "ok" for value in report.values())
    return JsonResponse(report, status=200 if ready else 503)
