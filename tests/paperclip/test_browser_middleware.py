"""Sessions, CSRF, the session's user and messages run for the console and for a logged-in
browser using the API, and are skipped only by API requests that carry an agent key or a
board token (paperclip/api/middleware.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from django.test import Client, RequestFactory
from rest_framework.test import APIClient

from paperclip.api.middleware import carries_api_credential
from paperclip.models import Agent, Company
from tests.paperclip.factories import UserFactory

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(
    ("path", "header", "skipped"),
    [
        ("/api/me", "Bearer pcak_abc.def", True),
        ("/api/me", "bearer PCBT_abc.def", True),
        ("/api/me", "Bearer pcak_", True),  # malformed: DRF answers 401, never the session
        ("/api/me", None, False),
        ("/api/me", "Bearer some-metrics-token", False),
        ("/api/me", "Basic cGNha186eA==", False),
        ("/admin/", "Bearer pcak_abc.def", False),  # the console always has its session
        ("/metrics", "Bearer pcak_abc.def", False),
    ],
)
def test_which_requests_skip_the_browser_middleware(
    path: str, header: str | None, skipped: bool
) -> None:
    extra = {} if header is None else {"HTTP_AUTHORIZATION": header}
    assert carries_api_credential(RequestFactory().get(path, **extra)) is skipped


def test_an_agent_request_gets_no_session_cookie_and_works(
    agent: Agent, make_agent_client: Callable[[Agent], APIClient]
) -> None:
    response = make_agent_client(agent).get("/api/me")
    assert response.status_code == 200
    assert response.json()["agent_id"] == str(agent.pk)
    assert not hasattr(response.wsgi_request, "session")
    assert "sessionid" not in response.cookies
    assert "csrftoken" not in response.cookies


def test_a_logged_in_board_member_uses_the_api_through_the_session_with_csrf(
    company: Company,
) -> None:
    user = UserFactory(is_staff=True)
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    assert client.get("/api/me").status_code == 200  # the session authenticates
    # An unsafe method without the CSRF token is refused: the session path still checks it.
    response = client.post("/api/companies", {"name": "x"}, content_type="application/json")
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "permission_denied"
    assert "CSRF" in response.json()["error"]["message"]


def test_a_bad_api_credential_is_401_even_with_a_valid_session(company: Company) -> None:
    client = Client()
    client.force_login(UserFactory(is_staff=True))
    response = client.get("/api/me", HTTP_AUTHORIZATION="Bearer pcak_0123.wrong")
    assert response.status_code == 401


def test_the_console_keeps_its_session_whatever_the_authorization_header() -> None:
    client = Client()
    client.force_login(UserFactory(is_staff=True, is_superuser=True))
    response = client.get("/admin/", HTTP_AUTHORIZATION="Bearer pcak_abc.def")
    assert response.status_code == 200
    assert response.wsgi_request.user.is_authenticated
