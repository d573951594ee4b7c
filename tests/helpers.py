"""Assertions and helpers shared by every test package."""

from __future__ import annotations

from typing import Any

import psycopg

from paperclip.db.advisory import connection_params


def assert_error(response: Any, status: int, code: str) -> dict[str, Any]:
    """The response is the one error shape with this status and code; returns the error."""
    assert response.status_code == status, (response.status_code, response.content)
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert error["code"] == code
    assert isinstance(error["message"], str)
    assert error["message"]
    assert isinstance(error["details"], dict)
    return error


def raw_connection(*, autocommit: bool = True) -> psycopg.Connection[Any]:
    """A psycopg connection to the test database outside the application (an observer, a
    lock holder, a second backend)."""
    return psycopg.connect(**connection_params(), autocommit=autocommit)
