"""The claim endpoint's lean path: an agent's renew without DRF's generic machinery.

`POST /api/execution-workspaces/{id}/runtime-lease/claim` is the most frequent request (every
agent renews every few seconds), and DRF's request wrapping, authentication loop, permission
and negotiation steps, serializer validation and response rendering were most of its Python
time (docs/performance.md#the-renew-path). This view serves the common, well-formed agent
request itself, through the same pieces the DRF view uses:

- the agent key is checked by `paperclip.api.auth.authenticate_agent_key`, the function
  `AgentKeyAuthentication` calls (one prepared SELECT, revocation read on every request:
  nothing is cached);
- the body is parsed by `paperclip.api.parsers.parse_json_body`, the strict parser's own
  function (UTF-8, depth, NUL, lone surrogates, non-finite numbers);
- the values are taken only when they are plainly what `RuntimeLeaseClaimApi.InputSerializer`
  accepts (its fields, their JSON types, the choices and the TTL range);
- the same service is called, and its answer rendered by the same serializers' fields, as
  compact ASCII JSON exactly as DRF's JSONRenderer writes it, with the DRF view's headers;
- an exception the service raises is answered by the API's one exception handler.

Anything else (no agent key, a board token or a session, a failed authentication, a body
that is not plainly valid, a query string, another `Accept` or media type) is handed to the
DRF view untouched, which answers it exactly as before: every error the endpoint can give
before the service runs comes from the DRF view itself. The DRF view stays the OpenAPI
document's source (this function carries its class, as `as_view()` does) and can be served
alone with `PAPERCLIP_LEAN_CLAIM_VIEW=false` (bench/renew_load.py compares both).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any, Final
from uuid import UUID

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt

from leases import services
from leases.api.views import LeaseSerializer, RuntimeLeaseClaimApi
from paperclip.api.auth import authenticate_agent_key
from paperclip.api.bodies import RequestBodyIncomplete
from paperclip.api.errors import exception_handler
from paperclip.api.parsers import parse_json_body
from paperclip.api.serializers import shared_serializer
from paperclip.ids import parse_count, parse_uuid

# Larger bodies go through DRF (and Django's upload limit); a renew's is under 200 bytes.
MAX_LEAN_BODY: Final = 4096
_PLAIN_ACCEPTS: Final = frozenset({None, "*/*", "application/json"})
_AGENT_BEARER: Final = "bearer pcak_"
# The DRF view's own response headers (APIView.default_response_headers: one renderer, so no
# `Vary: Accept`); a test holds the two paths' headers equal.
_ALLOW: Final = ", ".join(
    method.upper() for method in ("post", "options") if hasattr(RuntimeLeaseClaimApi, method)
)

drf_view = RuntimeLeaseClaimApi.as_view()


@functools.cache
def _fields() -> frozenset[str]:
    return frozenset(RuntimeLeaseClaimApi.InputSerializer().fields)


def plain_claim_values(data: Any) -> dict[str, Any] | None:
    """`data` (a parsed body) as the values `validated_body(InputSerializer, data)` would
    return, when it is plainly valid: an object of the serializer's fields only, `action` one
    of the leased actions, ids null or canonical UUID strings, `ttl_seconds` null or a whole
    number in range. None for anything else, which the DRF view then validates (and refuses)
    itself; a test holds this equal to the serializer on valid and invalid bodies."""
    if type(data) is not dict or not data.keys() <= _fields():
        return None
    action = data.get("action")
    if type(action) is not str or action not in services.LEASED_ACTIONS:
        return None
    values: dict[str, Any] = {"action": action}
    for name in ("issue_id", "run_id"):
        if name in data:
            raw = data[name]
            if raw is None:
                values[name] = None
            elif type(raw) is str and (parsed := parse_uuid(raw)) is not None:
                values[name] = parsed
            else:
                return None
    if "ttl_seconds" in data:
        ttl = data["ttl_seconds"]
        if ttl is not None and not (
            type(ttl) is int and services.TTL_MIN_SECONDS <= ttl <= services.TTL_MAX_SECONDS
        ):
            return None
        values["ttl_seconds"] = ttl
    return values


def _lease_json(lease: services.RuntimeLease | None) -> dict[str, Any] | None:
    return None if lease is None else shared_serializer(LeaseSerializer).to_representation(lease)


def _reclaimed_json(reclaimed: services.ReclaimedFrom | None) -> dict[str, Any] | None:
    if reclaimed is None:
        return None
    return {name: getattr(reclaimed, name) for name in RECLAIMED_FROM_KEYS}


def _as_is(value: Any) -> Any:
    return value


# The claim's answer as the lean path renders it: one entry per key of
# `RuntimeLeaseClaimApi.OutputSerializer`, read from the result's attribute of that name. The
# keys are the serializer's, not a second list: `lean_keys_mismatch` compares the two, the lean
# path declines (the DRF view answers) while they differ, and a test fails on it.
CLAIM_RENDERERS: Final[dict[str, Callable[[Any], Any]]] = {
    "outcome": _as_is,
    "owner_key": _as_is,
    "lease": _lease_json,
    "reclaimed_from": _reclaimed_json,
}
# `reclaimed_from`'s keys, plain values (the nested serializer's fields).
RECLAIMED_FROM_KEYS: Final = ("owner_key", "reason")


def _serializer_keys() -> tuple[tuple[str, ...], tuple[str, ...]]:
    fields = RuntimeLeaseClaimApi.OutputSerializer().fields
    return tuple(fields), tuple(getattr(fields.get("reclaimed_from"), "fields", {}))


def lean_keys_mismatch() -> str | None:
    """Where the lean rendering's keys differ from the OutputSerializer's (a field added to
    the serializer and not here, or removed), or None when they are one set."""
    top, nested = _serializer_keys()
    if top != tuple(CLAIM_RENDERERS):
        return f"OutputSerializer {top} != lean {tuple(CLAIM_RENDERERS)}"
    if nested != RECLAIMED_FROM_KEYS:
        return f"OutputSerializer.reclaimed_from {nested} != lean {RECLAIMED_FROM_KEYS}"
    return None


@functools.cache
def _lean_rendering_complete() -> bool:
    return lean_keys_mismatch() is None


def claim_json(result: services.RuntimeLeaseClaim) -> dict[str, Any]:
    """`RuntimeLeaseClaimApi.OutputSerializer`'s rendering of `result`, without walking the
    serializer's fields (a test holds the two equal for every outcome)."""
    return {name: render(getattr(result, name)) for name, render in CLAIM_RENDERERS.items()}


def render(data: Any, status: int) -> HttpResponse:
    """`data` as DRF's JSONRenderer writes it with this project's settings (compact, ASCII,
    no NaN) in the DRF view's response."""
    content = json.dumps(data, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    response = HttpResponse(content.encode(), status=status, content_type="application/json")
    response["Allow"] = _ALLOW
    return response


def _lean_request(request: HttpRequest) -> bool:
    """A request the lean path may take: an agent key, JSON sent and accepted plainly, no
    query string, a small body of known length."""
    meta = request.META
    header = meta.get("HTTP_AUTHORIZATION")
    length = meta.get("CONTENT_LENGTH")
    return (
        request.method == "POST"
        and isinstance(header, str)
        and header[:12].lower() == _AGENT_BEARER
        and not meta.get("QUERY_STRING")
        and meta.get("HTTP_ACCEPT") in _PLAIN_ACCEPTS
        and meta.get("CONTENT_TYPE") == "application/json"
        and (parse_count(length, high=MAX_LEAN_BODY) or 0) > 0
        and settings.PAPERCLIP_LEAN_CLAIM_VIEW
        and _lean_rendering_complete()  # else a field would be dropped: the DRF view answers
    )


def lean_claim(request: HttpRequest, workspace_id: UUID) -> HttpResponse | None:
    """The lean path's answer to `request`, or None when the DRF view is to answer it (not
    plainly a valid agent renew or claim)."""
    if not _lean_request(request):
        return None
    try:
        authenticated = authenticate_agent_key(request.META["HTTP_AUTHORIZATION"])
    except Exception:  # the database failed: the DRF view says so
        return None
    if authenticated is None:
        return None  # the DRF view answers 401 (it reads no body for that)
    try:
        body = request.body  # authenticated first, as the DRF view does
    except RequestBodyIncomplete as exc:  # read part way: the DRF view could not read it now
        return _as_drf_answers(exc, request)
    try:
        values = plain_claim_values(parse_json_body(body))
    except Exception:  # malformed: the DRF view says how
        return None
    if values is None:
        return None  # not plainly valid: the DRF view answers it, error and all
    agent = authenticated[0]
    # As DRF's authentication sets it (an Agent is the user): the request's log line names it.
    request.user = agent  # type: ignore[assignment]
    try:
        result = services.runtime_lease_claim(
            company_id=agent.company_id,
            execution_workspace_id=workspace_id,
            action=values["action"],
            owner=services.RuntimeLeaseOwner.for_agent(
                agent.pk, run_id=values.get("run_id"), issue_id=values.get("issue_id")
            ),
            ttl_seconds=values.get("ttl_seconds"),
        )
    except Exception as exc:
        return _as_drf_answers(exc, request)
    return render(claim_json(result), 200)


def _as_drf_answers(exc: Exception, request: HttpRequest) -> HttpResponse:
    """`exc` answered as the DRF view's exception handler answers it (status, JSON, headers)."""
    handled = exception_handler(exc, {"view": RuntimeLeaseClaimApi(), "request": request})
    if handled is None:  # pragma: no cover - the handler answers every exception
        raise exc
    response = render(handled.data, handled.status_code)
    for name, value in handled.items():
        if name.lower() != "content-type":  # (Retry-After, ...)
            response[name] = value
    return response


@csrf_exempt
def runtime_lease_claim_view(request: HttpRequest, workspace_id: UUID) -> HttpResponse:
    answered = lean_claim(request, workspace_id)
    if answered is None:  # the body stays readable for the DRF view
        return drf_view(request, workspace_id=workspace_id)
    return answered


# The OpenAPI document (drf-spectacular) and anything else that inspects the URL conf see the
# DRF view: its class, serializers and schema, as on `RuntimeLeaseClaimApi.as_view()`.
for _attribute in ("cls", "initkwargs", "view_class", "view_initkwargs"):
    setattr(runtime_lease_claim_view, _attribute, getattr(drf_view, _attribute))
