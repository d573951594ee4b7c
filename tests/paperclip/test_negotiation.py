"""The API's content negotiation answers the common `Accept` values at once, and exactly as
DRF's own negotiation does for every value."""

from __future__ import annotations

import pytest
from django.http import Http404
from rest_framework.exceptions import NotAcceptable
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.renderers import BaseRenderer, JSONRenderer
from rest_framework.request import Request
from rest_framework.test import APIRequestFactory

from paperclip.api.negotiation import JsonContentNegotiation

ACCEPTS = [
    None,
    "",  # an empty Accept accepts nothing: 406
    "*/*",
    "application/json",
    "application/json; q=0.9",
    "application/*",
    "text/html",
    "text/html, application/json;q=0.1",
    "image/png",
]


def _select(negotiation: DefaultContentNegotiation, accept: str | None, path: str) -> object:
    extra = {} if accept is None else {"HTTP_ACCEPT": accept}
    request = Request(APIRequestFactory().get(path, **extra))
    renderers: list[BaseRenderer] = [JSONRenderer()]
    try:
        renderer, media_type = negotiation.select_renderer(request, renderers)
    except NotAcceptable as exc:
        return ("406", str(exc.detail))
    except Http404:
        return "404"
    return (type(renderer), media_type)


@pytest.mark.parametrize("path", ["/api/me", "/api/me?format=json", "/api/me?format=html"])
@pytest.mark.parametrize("accept", ACCEPTS)
def test_the_answer_is_drfs(accept: str | None, path: str) -> None:
    expected = _select(DefaultContentNegotiation(), accept, path)
    assert _select(JsonContentNegotiation(), accept, path) == expected


@pytest.mark.django_db
def test_a_client_accepting_only_html_gets_406(agent_client) -> None:
    response = agent_client.get("/api/me", HTTP_ACCEPT="text/html")
    assert response.status_code == 406
    assert agent_client.get("/api/me", HTTP_ACCEPT="*/*").status_code == 200
