"""The one error model of the HTTP API and the only kind-to-status table.

Every error response is `{"error": {"code", "message", "details", "remediation"?}}`.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable
from typing import Any

from django import db
from django.conf import settings
from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import RequestDataTooBig
from django.db import OperationalError
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler
from rest_framework.views import set_rollback

from paperclip.db.errors import connection_lost
from paperclip.errors import DomainError, ResourceBusy
from paperclip.observability.context import context_update

logger = logging.getLogger(__name__)


def _view_name(context: dict[str, Any]) -> str:
    view = context.get("view")
    return type(view).__name__ if view is not None else "a view"


def error_body(
    code: str, message: str, details: dict[str, Any] | None = None, remediation: str | None = None
) -> dict[str, Any]:
    error: dict[str, Any] = {"code": code, "message": message, "details": details or {}}
    context_update(error=code)  # the request's log line and paperclip_api_errors_total
    if remediation:
        error["remediation"] = remediation
    return {"error": error}


def domain_error_response(exc: DomainError) -> Response:
    response = Response(
        error_body(exc.code, exc.text, exc.details, exc.remediation_text),
        status=exc.status_code,
    )
    if exc.retry_after_seconds is not None:
        response["Retry-After"] = str(exc.retry_after_seconds)
    return response


def _flatten(detail: Any) -> Any:
    if isinstance(detail, dict):
        return {str(k): _flatten(v) for k, v in detail.items()}
    if isinstance(detail, list):
        return [_flatten(v) for v in detail]
    return str(detail)


_DRF_CODES: dict[type[exceptions.APIException], tuple[str, str]] = {
    exceptions.NotAuthenticated: (
        "not_authenticated",
        "Authentication credentials were not provided.",
    ),
    exceptions.AuthenticationFailed: ("not_authenticated", "Invalid authentication credentials."),
    exceptions.PermissionDenied: (
        "permission_denied",
        "You do not have permission to perform this action.",
    ),
    exceptions.NotFound: ("not_found", "Not found."),
    exceptions.MethodNotAllowed: ("method_not_allowed", "Method not allowed."),
    exceptions.NotAcceptable: ("not_acceptable", "Not acceptable."),
    exceptions.UnsupportedMediaType: ("unsupported_media_type", "Unsupported media type."),
    exceptions.Throttled: ("throttled", "Request was throttled."),
}


DATABASE_RETRY_AFTER_SECONDS = 2


def _unavailable_body() -> dict[str, Any]:
    return error_body(
        "database_unavailable",
        "The database became unavailable during the request. Each write commits whole "
        "or not at all: retry it.",
        remediation="Retry after the number of seconds in the Retry-After header.",
    )


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    if isinstance(exc, DomainError):
        set_rollback()
        return domain_error_response(exc)
    if isinstance(exc, OperationalError) and _conflict(exc):
        # Two transactions met (a deadlock PostgreSQL broke, a lock wait that expired): the
        # request changed nothing and may be repeated, as any `resource_busy`; the database
        # is there (not `database_unavailable`, whose connection would be dropped).
        logger.warning("concurrency conflict in %s: %s", _view_name(context), exc)
        set_rollback()
        return domain_error_response(ResourceBusy())
    if connection_lost(exc):
        return _database_unavailable(exc, context)
    if isinstance(exc, RequestDataTooBig):
        return Response(_too_large_body(), status=status.HTTP_413_REQUEST_ENTITY_TOO_LARGE)
    if isinstance(exc, Http404):
        exc = exceptions.NotFound()
    elif isinstance(exc, DjangoPermissionDenied):
        exc = exceptions.PermissionDenied()
    handled = drf_exception_handler(exc, context)
    if handled is None:
        # Unknown: logged with its traceback, answered with the one error body (also with
        # DEBUG on, so that `make run` shows what production shows), leaking nothing.
        logger.error("unhandled error in %s", _view_name(context), exc_info=exc)
        set_rollback()
        return Response(
            error_body("internal_error", "The server failed to handle the request."),
            status=status.HTTP_500_INTERNAL_SERVER_ERROR,
        )
    return _rewrapped(exc, handled)


# deadlock_detected, serialization_failure, lock_not_available
_CONFLICT_STATES = frozenset({"40P01", "40001", "55P03"})


def _conflict(exc: OperationalError) -> bool:
    return getattr(exc.__cause__, "sqlstate", None) in _CONFLICT_STATES


def _database_unavailable(exc: Exception, context: dict[str, Any]) -> Response:
    # The request's transaction is gone with its connection; drop the connection so the
    # next request opens a fresh one, and tell the client to retry.
    logger.warning("database unavailable during %s: %s", _view_name(context), exc)
    with contextlib.suppress(Exception):
        db.connection.close()
    response = Response(_unavailable_body(), status=status.HTTP_503_SERVICE_UNAVAILABLE)
    response["Retry-After"] = str(DATABASE_RETRY_AFTER_SECONDS)
    return response


def _rewrapped(exc: Exception, response: Response) -> Response:
    """DRF's response to `exc` with the one error body: serializer errors as 400
    `invalid_request` with `details.fields`, the others by their code."""
    if isinstance(exc, exceptions.ValidationError):
        fields = exc.detail if isinstance(exc.detail, dict) else {"non_field_errors": exc.detail}
        response.data = error_body(
            "invalid_request", "The request is malformed.", {"fields": _flatten(fields)}
        )
        response.status_code = status.HTTP_400_BAD_REQUEST
        return response
    if isinstance(exc, exceptions.ParseError):
        response.data = error_body(
            "invalid_request", "The request body is not valid JSON.", {"fields": {}}
        )
        return response
    code, message = _drf_code(exc)
    if isinstance(exc, exceptions.APIException) and isinstance(exc.detail, str):
        message = str(exc.detail)
    response.data = error_body(code, message)
    return response


def _drf_code(exc: Exception) -> tuple[str, str]:
    """The code and default message of a DRF error: from the table, else its `default_code`."""
    for kind, (kind_code, kind_message) in _DRF_CODES.items():
        if isinstance(exc, kind):
            return kind_code, kind_message
    if isinstance(exc, exceptions.APIException):
        return str(exc.default_code), "The request failed."
    return "error", "The request failed."


def _too_large_body() -> dict[str, Any]:
    return error_body(
        "request_too_large",
        "The request body is larger than the server accepts.",
        {"max_bytes": settings.DATA_UPLOAD_MAX_MEMORY_SIZE},
    )


def json_not_found(request: HttpRequest, exception: Exception | None = None) -> JsonResponse:
    """handler404: a JSON body for the API (a malformed UUID in a path lands here)."""
    return JsonResponse(error_body("not_found", "Not found."), status=404)


def json_bad_request(request: HttpRequest, exception: Exception | None = None) -> JsonResponse:
    """handler400: Django-level rejections (an oversized body, a suspicious header) as JSON."""
    if isinstance(exception, RequestDataTooBig):
        return JsonResponse(_too_large_body(), status=413)
    return JsonResponse(
        error_body("invalid_request", "The request was rejected.", {"fields": {}}), status=400
    )


def json_server_error(request: HttpRequest) -> HttpResponse:
    """handler500: never leaks internals. A lost database (the exception being handled) is a
    503 to retry, not a 500."""
    lost = sys.exc_info()[1]
    if lost is not None and connection_lost(lost):
        return database_unavailable_response(request, lost)
    return JsonResponse(error_body("internal_error", "Internal server error."), status=500)


_UNAVAILABLE_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><meta http-equiv="refresh" content="{seconds}">
<title>Database unavailable</title></head>
<body><h1>The database is unavailable</h1>
<p>The control plane lost its database connection (a restart or a failover). Nothing was
half-done: each change commits whole or not at all. This page reloads in {seconds} seconds.</p>
</body></html>
"""


def database_unavailable_response(request: HttpRequest, exc: BaseException) -> HttpResponse:
    """503 with Retry-After for a request whose database connection failed: the API's JSON
    error under /api/, a page that reloads itself elsewhere (docs/ha.md#during-a-failover).
    The broken connection is closed so the next request opens a fresh one."""
    logger.warning("database unavailable during %s: %s", request.path, exc)
    with contextlib.suppress(Exception):
        db.connection.close()
    response: HttpResponse
    if request.path.startswith("/api/"):
        response = JsonResponse(_unavailable_body(), status=503)
    else:
        response = HttpResponse(
            _UNAVAILABLE_PAGE.format(seconds=DATABASE_RETRY_AFTER_SECONDS), status=503
        )
    response["Retry-After"] = str(DATABASE_RETRY_AFTER_SECONDS)
    return response


class DatabaseUnavailableMiddleware:
    """A view of any kind (the console's included) whose database connection fails answers
    503 with Retry-After, never 500; DRF views get the same from `exception_handler`, and
    handler500 covers what fails outside a view."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)

    def process_exception(self, request: HttpRequest, exc: Exception) -> HttpResponse | None:
        return database_unavailable_response(request, exc) if connection_lost(exc) else None


# Django's own error pages that may reach an API path (an unknown path under DEBUG is its
# technical 404 page; handler404 only applies without DEBUG): the codes they become.
_DJANGO_ERROR_CODES: dict[int, tuple[str, str]] = {
    400: ("invalid_request", "The request was rejected."),
    403: ("permission_denied", "Permission denied."),
    404: ("not_found", "Not found."),
    405: ("method_not_allowed", "Method not allowed."),
    413: ("request_too_large", "The request body is too large."),
}


class ApiJsonErrorsMiddleware:
    """Every `/api/` path answers its errors in the API's one JSON body, whatever
    `DJANGO_DEBUG` says: an HTML error page from Django itself is replaced (a JSON body,
    already the API's, passes untouched). Costs one comparison on a successful response."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return api_json_error(request, self.get_response(request))


def api_json_error(request: HttpRequest, response: HttpResponse) -> HttpResponse:
    """`response`, or for an error on an `/api/` path that is not JSON, the API's JSON error
    in its place (ApiJsonErrorsMiddleware's step)."""
    if response.status_code < 400 or not request.path.startswith("/api/"):
        return response
    if response.get("Content-Type", "").startswith("application/json"):
        return response
    code, message = _DJANGO_ERROR_CODES.get(
        response.status_code,
        ("internal_error", "Internal server error.")
        if response.status_code >= 500
        else ("invalid_request", "The request was rejected."),
    )
    replaced = JsonResponse(error_body(code, message), status=response.status_code)
    for header in ("Allow", "Retry-After", "X-Request-ID"):
        if header in response:
            replaced[header] = response[header]
    return replaced
