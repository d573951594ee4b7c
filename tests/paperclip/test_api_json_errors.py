"""Every `/api/` path answers errors in the API's JSON body, with `DJANGO_DEBUG` on as under
`make run` (Django's own HTML error pages are replaced), and pages outside the API keep
Django's pages."""

from __future__ import annotations

import pytest
from django.test import Client, override_settings

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("debug", [True, False])
@pytest.mark.parametrize("path", ["/api/no-such-thing", "/api/issues/not-a-uuid", "/api/cas/x/y"])
def test_unknown_api_paths_are_a_json_404_with_or_without_debug(debug: bool, path: str) -> None:
    with override_settings(DEBUG=debug):
        response = Client().get(path)
    assert response.status_code == 404
    assert response["Content-Type"].startswith("application/json")
    assert response.json()["error"]["code"] == "not_found"


@override_settings(DEBUG=True)
def test_a_page_outside_the_api_keeps_djangos_404() -> None:
    response = Client().get("/no-such-page")
    assert response.status_code == 404
    assert response["Content-Type"].startswith("text/html")


@override_settings(DEBUG=True)
def test_an_api_json_error_passes_untouched() -> None:
    response = Client().get("/api/me")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "not_authenticated"
