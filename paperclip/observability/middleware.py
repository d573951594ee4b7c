"""The request's id, its metrics and its one log line (docs/operations.md#logs)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from contextvars import Token
from typing import Any

from django.http import HttpRequest, HttpResponse
from django.utils.functional import SimpleLazyObject

from paperclip.models import Agent
from paperclip.observability import metrics
from paperclip.observability.context import log_context, request_id_accept

logger = logging.getLogger("paperclip.request")

_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
# URL keyword arguments worth a field in the request's log line.
_ID_KWARGS = ("run_id", "workspace_id", "issue_id", "lease_id", "action_id", "company_id")


def _route(request: HttpRequest) -> str:
    """The URL pattern's name, never the raw path: label values must stay a bounded set."""
    match = request.resolver_match
    if match is None:
        return "unmatched"
    return match.view_name or match.route or "unnamed"


def _actor(request: HttpRequest) -> dict[str, str | None]:
    """Who made the request, as far as the request itself found out. A console user the view
    never looked up stays unresolved: resolving it here would load the session, a query the
    request did not need, and a second failure (a 500) when the database has just gone away."""
    user = getattr(request, "user", None)
    if isinstance(user, SimpleLazyObject):
        user = request.__dict__.get("_cached_user")
    if isinstance(user, Agent):
        return {"actor_type": "agent", "actor_id": str(user.pk), "company_id": str(user.company_id)}
    if user is not None and getattr(user, "is_authenticated", False):
        return {"actor_type": "board", "actor_id": str(user.pk)}
    return {}


def request_begin(request: HttpRequest) -> tuple[str, dict[str, object], Token[Any]]:
    """The request's id and its log context, set for everything it logs: (request id,
    context, the token that resets it)."""
    request_id = request_id_accept(request.META.get("HTTP_X_REQUEST_ID"))
    context: dict[str, object] = {"request_id": request_id}
    return request_id, context, log_context.set(context)


def request_end(
    request: HttpRequest,
    response: HttpResponse,
    *,
    request_id: str,
    context: dict[str, object],
    elapsed: float,
    route: str,
    url_kwargs: Mapping[str, object],
) -> None:
    """What every answered request records: its X-Request-ID header, the HTTP counters and its
    one log line."""
    response["X-Request-ID"] = request_id
    method = request.method if request.method in _METHODS else "OTHER"
    status = response.status_code
    metrics.HTTP_REQUESTS.labels(route, method, str(status)).inc()
    metrics.HTTP_DURATION.labels(route, method).observe(elapsed)
    error = context.get("error")
    if status >= 400 and isinstance(error, str):
        metrics.error_observed(error, status)
    ids = {key: str(value) for key, value in url_kwargs.items() if key in _ID_KWARGS}
    context.update(_actor(request))
    logger.info(
        "%s %s %s %.1f ms",
        method,
        route,
        status,
        elapsed * 1000,
        extra={
            "http": {
                "route": route,
                "method": method,
                "status": status,
                "duration_ms": round(elapsed * 1000, 3),
                **ids,
            }
        },
    )


class RequestObservabilityMiddleware:
    """First in MIDDLEWARE: every response carries X-Request-ID (an upstream proxy's, when it
    is a safe token, else a new one), every request moves the HTTP counters and writes one line
    to `paperclip.request`: route, method, status, duration, actor, company, the ids in the URL
    and the error code. Never the body, the query string or a header's value."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        request_id, context, token = request_begin(request)
        started = time.perf_counter()
        try:
            response = self.get_response(request)
            match = request.resolver_match
            request_end(
                request,
                response,
                request_id=request_id,
                context=context,
                elapsed=time.perf_counter() - started,
                route=_route(request),
                url_kwargs=match.kwargs if match else {},
            )
            return response
        finally:
            log_context.reset(token)
