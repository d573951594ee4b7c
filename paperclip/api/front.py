"""Requests answered ahead of Django's handler and middleware chain.

An agent renews its runtime lease every few seconds: that one request sets how many agents a
node carries, and once its view was lean (leases/api/lean.py), Django's handler around it
(the exception wrapper of each of the eleven middleware, URL resolving, the credential
middleware's checks) was a sizeable part of what was left
(docs/performance.md#the-renew-path). An app registers such a view here
(`front_route_register`, from its `ready()`); `paperclip.wsgi` offers every request to
`answer` first, which serves it when a registered path matches and the view takes it, and
otherwise leaves it to Django untouched.

What the request still goes through is Django's own code, called directly rather than through
the chain: the `request_started` and `request_finished` signals (database connection upkeep),
the script prefix, `get_host()` against ALLOWED_HOSTS, SecurityMiddleware's redirect check and
response headers, the clickjacking header, CommonMiddleware's response step (Content-Length),
the request's id, its metrics and its one log line (`paperclip.observability.middleware`), and
an exception escaping the view answered as the handler would. A request any of those would
answer itself (a disallowed host, an HTTPS redirect), a body of unknown or large size, a
script prefix, or a view that declines (returns None) goes to Django's handler instead, the
body still unread; so does every request when MIDDLEWARE is not the chain the front mirrors.
`tests/leases/api/test_claim_front.py` holds both paths' answers, headers, audit rows, metrics
and log lines equal.
"""

from __future__ import annotations

import io
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Final

from django.conf import settings
from django.core import signals
from django.core.handlers.exception import response_for_exception
from django.core.handlers.wsgi import WSGIHandler, WSGIRequest, get_script_name
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.middleware.clickjacking import XFrameOptionsMiddleware
from django.middleware.common import CommonMiddleware
from django.middleware.security import SecurityMiddleware
from django.urls import set_script_prefix

from paperclip.api.bodies import BODY_INCOMPLETE, BODY_PROBLEM, RequestBodyIncomplete
from paperclip.api.errors import api_json_error, database_unavailable_response
from paperclip.db.errors import connection_lost
from paperclip.observability.context import log_context
from paperclip.observability.middleware import request_begin, request_end

# A front view answers the request, or declines (None): Django's handler then serves it.
FrontView = Callable[..., HttpResponse | None]

# Larger bodies are Django's (and its upload limit's) to read.
MAX_FRONT_BODY: Final = 4096


@dataclass(frozen=True)
class FrontRoute:
    method: str
    pattern: re.Pattern[str]  # PATH_INFO, fully matched; named groups are the view's kwargs
    convert: Callable[[dict[str, str]], dict[str, Any] | None]  # None: not this route
    route: str  # the URL pattern's name: the metrics' and the log line's route
    view: FrontView


_ROUTES: list[FrontRoute] = []

# The middleware chain whose steps `answer` makes itself. Any other MIDDLEWARE setting (one
# added, removed or reordered) turns the front off: every request then goes to the handler.
MIRRORED_MIDDLEWARE: Final = (
    "paperclip.observability.middleware.RequestObservabilityMiddleware",
    "paperclip.api.errors.ApiJsonErrorsMiddleware",
    # Nothing to do here: the front takes only bodies of a known small length, and declines
    # (and marks) one cut short, which the middleware then answers in Django's chain.
    "paperclip.api.bodies.RequestBodyMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "paperclip.api.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "paperclip.api.middleware.CsrfViewMiddleware",
    "paperclip.api.middleware.AuthenticationMiddleware",
    "paperclip.api.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "paperclip.api.errors.DatabaseUnavailableMiddleware",
)


def front_route_register(route: FrontRoute) -> None:
    """Serve `route` ahead of Django's handler (once per route name)."""
    _ROUTES[:] = [known for known in _ROUTES if known.route != route.route] + [route]


def _never(request: HttpRequest) -> HttpResponseBase:  # pragma: no cover - never called
    raise AssertionError("the front calls the middleware's steps, not the chain")


# Django's own middleware, whose request and response steps the front calls in MIDDLEWARE's
# order (outermost last on the way out).
_SECURITY = SecurityMiddleware(_never)
_COMMON = CommonMiddleware(_never)
_CLICKJACKING = XFrameOptionsMiddleware(_never)


def _match(environ: dict[str, Any]) -> tuple[FrontRoute, dict[str, Any]] | None:
    method = environ.get("REQUEST_METHOD")
    path = environ.get("PATH_INFO", "")
    for route in _ROUTES:
        if route.method != method:
            continue
        found = route.pattern.fullmatch(path)
        if found is not None:
            kwargs = route.convert(found.groupdict())
            return None if kwargs is None else (route, kwargs)
    return None


def _body(environ: dict[str, Any]) -> bytes | None:
    """A small body of known length, read once and put back as a fresh stream for the view
    (`_rewind` puts it back again for Django's handler after a decline)."""
    length = environ.get("CONTENT_LENGTH")
    if not isinstance(length, str) or not length.isdigit() or int(length) > MAX_FRONT_BODY:
        return None
    try:
        body: bytes = environ["wsgi.input"].read(int(length))
    except RequestBodyIncomplete:  # marked: RequestBodyMiddleware answers it in the chain
        _rewind(environ, b"")
        return None
    if len(body) < int(length):  # a stream that is not ExactBody (no paperclip.wsgi)
        environ[BODY_PROBLEM] = BODY_INCOMPLETE
        _rewind(environ, b"")
        return None
    _rewind(environ, body)
    return body


def _rewind(environ: dict[str, Any], body: bytes) -> None:
    environ["wsgi.input"] = io.BytesIO(body)


def answer(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes] | None:
    """Serve a registered route's request here; None leaves it to Django's handler."""
    if (
        not _ROUTES
        or not settings.PAPERCLIP_FRONT_ROUTES
        or tuple(settings.MIDDLEWARE) != MIRRORED_MIDDLEWARE
        or environ.get("SCRIPT_NAME")
        or settings.FORCE_SCRIPT_NAME is not None
    ):
        return None
    matched = _match(environ)
    if matched is None:
        return None
    body = _body(environ)
    if body is None:
        return None
    route, kwargs = matched
    request = WSGIRequest(environ)
    try:
        if _SECURITY.process_request(request) or _COMMON.process_request(request):
            return None  # an HTTPS redirect, PREPEND_WWW: Django's handler answers them
    except Exception:  # a disallowed host or user agent: Django answers (and logs) it
        return None
    set_script_prefix(get_script_name(environ))
    signals.request_started.send(sender=WSGIHandler, environ=environ)
    request_id, context, token = request_begin(request)
    started = time.perf_counter()
    try:
        response: HttpResponseBase | None
        try:
            response = route.view(request, **kwargs)
        except Exception as exc:  # as DatabaseUnavailableMiddleware, then the handler, answer it
            if connection_lost(exc):
                response = database_unavailable_response(request, exc)
            else:
                response = response_for_exception(request, exc)
        if response is None:
            # Declined: Django's handler serves it, from the start (request_started again).
            signals.request_finished.send(sender=WSGIHandler)
            _rewind(environ, body)
            return None
        # SecurityMiddleware types its response as HttpResponse; it handles any response.
        response = _CLICKJACKING.process_response(request, response)
        response = _COMMON.process_response(request, response)
        response = _SECURITY.process_response(request, response)  # type: ignore[arg-type]
        response = api_json_error(request, response)
        request_end(
            request,
            response,
            request_id=request_id,
            context=context,
            elapsed=time.perf_counter() - started,
            route=route.route,
            url_kwargs=kwargs,
        )
    finally:
        log_context.reset(token)
    status = f"{response.status_code} {response.reason_phrase}"
    headers = [
        *response.items(),
        *(("Set-Cookie", cookie.OutputString()) for cookie in response.cookies.values()),
    ]
    start_response(status, headers)
    # The sender of request_finished on close, as Django's handler sets it.
    response._handler_class = WSGIHandler  # type: ignore[attr-defined]
    try:
        return [b"".join(response)]
    finally:
        response.close()  # request_finished
