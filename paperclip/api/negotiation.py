"""Content negotiation of the API: JSON is the only representation."""

from __future__ import annotations

from collections.abc import Iterable

from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.renderers import BaseRenderer
from rest_framework.request import Request

# What agents send (or nothing): each already selects the one renderer, JSON.
_PLAIN_ACCEPTS = frozenset({None, "*/*", "application/json"})


class JsonContentNegotiation(DefaultContentNegotiation):
    """DRF's negotiation, answered at once in the common case: one renderer (every endpoint
    renders JSON only), no query string and an `Accept` that takes it as it is. Any other
    `Accept`, a query string, a format suffix or a view with several renderers goes through
    DRF's full rules, so a client asking
    only for, say, `text/html` still gets 406. Parsing the header on every request was a few
    per cent of a renew (bench/renew_load.py)."""

    def select_renderer(
        self, request: Request, renderers: Iterable[BaseRenderer], format_suffix: str | None = None
    ) -> tuple[BaseRenderer, str]:
        renderers = list(renderers)
        if (
            len(renderers) == 1
            and format_suffix is None
            and not request.META.get("QUERY_STRING")  # (no `?format=` override either)
            and request.META.get("HTTP_ACCEPT") in _PLAIN_ACCEPTS
        ):
            renderer = renderers[0]
            return renderer, renderer.media_type
        result: tuple[BaseRenderer, str] = super().select_renderer(
            request, renderers, format_suffix
        )
        return result
