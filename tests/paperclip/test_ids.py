"""The one id rule: canonical UUID text in paths (Django's `<uuid:>`) and in bodies."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from django.urls import URLPattern, URLResolver, get_resolver
from rest_framework.test import APIClient

from paperclip.ids import is_uuid, parse_uuid

ID = uuid.UUID("6f1c2a3b-4d5e-4f60-8a7b-9c0d1e2f3a4b")


@pytest.mark.parametrize(
    "value",
    [str(ID), str(ID).upper(), ID],
)
def test_canonical_forms_parse(value: Any) -> None:
    assert parse_uuid(value) == ID


@pytest.mark.parametrize(
    "value",
    [
        f"{{{ID}}}",
        f"urn:uuid:{ID}",
        ID.hex,
        f" {ID}",
        f"{ID}\n",
        str(ID)[:-1],
        "",
        None,
        12,
        ID.int,
        ["x"],
        {"id": str(ID)},
    ],
)
def test_other_spellings_and_types_are_refused(value: Any) -> None:
    assert parse_uuid(value) is None
    assert not is_uuid(value)


def _api_routes() -> list[str]:
    """Every API route that takes an id in its path."""
    found: list[str] = []

    def walk(patterns: Any, prefix: str) -> None:
        for entry in patterns:
            if isinstance(entry, URLResolver):
                walk(entry.url_patterns, prefix + str(entry.pattern))
            elif isinstance(entry, URLPattern):
                route = prefix + str(entry.pattern)
                if route.startswith("api/") and "<" in route:
                    found.append(route)

    walk(get_resolver().url_patterns, "")
    return found


# A blob's name is its content's digest, not an id: a malformed name is 400 naming the field
# (docs/snapshots.md#the-store), as a malformed digest in a body is.
BLOB_ROUTES = {"api/cas/blobs/<str:name>"}


def test_every_api_path_id_uses_the_uuid_converter() -> None:
    routes = [route for route in _api_routes() if route not in BLOB_ROUTES]
    assert len(routes) >= 20
    offenders = [route for route in routes if "<str:" in route or "<path:" in route]
    assert offenders == []
    assert all("<uuid:" in route for route in routes)
    assert set(_api_routes()) >= BLOB_ROUTES  # the exemption stays current


@pytest.mark.django_db
@pytest.mark.parametrize("spelling", ["upper", "braced", "urn", "dashless"])
def test_non_canonical_path_ids_are_a_json_404_everywhere(spelling: str) -> None:
    text = {
        "upper": str(ID).upper(),
        "braced": f"{{{ID}}}",
        "urn": f"urn:uuid:{ID}",
        "dashless": ID.hex,
    }[spelling]
    client = APIClient()
    for route in _api_routes():
        if route in BLOB_ROUTES:
            continue
        path = "/" + _fill(route, text)
        for method in ("get", "post"):
            response = getattr(client, method)(path)
            assert response.status_code == 404, (method, path, response.status_code)
            assert response.json()["error"]["code"] == "not_found", path


def _fill(route: str, value: str) -> str:
    out, rest = "", route
    while "<" in rest:
        head, _, tail = rest.partition("<")
        _, _, rest = tail.partition(">")
        out += head + value
    return out + rest
