"""The browser's middleware (sessions, CSRF, the session's user, messages), skipped by API
requests that carry an API credential."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.contrib.auth import middleware as auth
from django.contrib.messages import middleware as messages
from django.contrib.sessions import middleware as sessions
from django.http import HttpRequest, HttpResponse, HttpResponseForbidden
from django.middleware import csrf

from paperclip.credentials import AGENT_KEY_KIND, BOARD_TOKEN_KIND

_API_PREFIX = "/api/"
_CREDENTIAL_PREFIXES = tuple(f"bearer {kind}_" for kind in (AGENT_KEY_KIND, BOARD_TOKEN_KIND))


def carries_api_credential(request: HttpRequest) -> bool:
    """An API request presenting an agent key or a board token (`Authorization: Bearer
    pcak_…` / `pcbt_…`): DRF authenticates it by that credential alone and never looks at a
    session (a malformed or wrong one is a 401, with no fallback to the session)."""
    header = request.META.get("HTTP_AUTHORIZATION")
    return (
        header is not None
        and request.path_info.startswith(_API_PREFIX)
        and header[:12].lower().startswith(_CREDENTIAL_PREFIXES)
    )


class _SkippedByApiCredential:
    """Run the Django middleware this is mixed into, except for a request that
    `carries_api_credential`.

    Sessions, CSRF, the session's user and messages serve the console and a board member using
    the API from a logged-in browser (DRF's session authentication). An agent's renew, the most
    frequent request, needs none of them, and building the session store and the message
    storage with its cookie signer on every request was a tenth of a renew's CPU
    (bench/renew_load.py). Such a request has no `request.session`, and a `request.user` only
    once DRF has authenticated it. (Subclasses rather than one wrapper: the admin's system
    checks look for these classes in MIDDLEWARE.)
    """

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if carries_api_credential(request):
            return self.get_response(request)  # type: ignore[attr-defined]
        return super().__call__(request)  # type: ignore[misc]


class SessionMiddleware(_SkippedByApiCredential, sessions.SessionMiddleware):
    pass


class AuthenticationMiddleware(_SkippedByApiCredential, auth.AuthenticationMiddleware):
    pass


class MessageMiddleware(_SkippedByApiCredential, messages.MessageMiddleware):
    pass


class CsrfViewMiddleware(_SkippedByApiCredential, csrf.CsrfViewMiddleware):
    def process_view(
        self,
        request: HttpRequest,
        callback: Callable[..., Any],
        callback_args: tuple[Any, ...],
        callback_kwargs: dict[str, Any],
    ) -> HttpResponseForbidden | None:
        if carries_api_credential(request):
            return None
        return super().process_view(request, callback, callback_args, callback_kwargs)
