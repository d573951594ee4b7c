"""A concurrency conflict PostgreSQL breaks (a deadlock, a serialization failure, an expired
lock wait) reaching the API is `resource_busy` (409: nothing changed, retry): it was answered
503 `database_unavailable`, and the request's connection dropped, as if the database were
gone."""

from __future__ import annotations

import pytest
from django.db import OperationalError

from paperclip.api.errors import exception_handler


class _Cause(Exception):
    def __init__(self, sqlstate: str) -> None:
        super().__init__(sqlstate)
        self.sqlstate = sqlstate


@pytest.mark.parametrize("sqlstate", ["40P01", "40001", "55P03"])
def test_a_conflict_the_database_broke_is_resource_busy(sqlstate: str) -> None:
    error = OperationalError("deadlock detected")
    error.__cause__ = _Cause(sqlstate)
    response = exception_handler(error, {"view": None})
    assert response is not None
    assert response.status_code == 409
    assert response.data["error"]["code"] == "resource_busy"


def test_a_lost_connection_is_still_database_unavailable() -> None:
    error = OperationalError("server closed the connection unexpectedly")
    error.__cause__ = _Cause("08006")
    response = exception_handler(error, {"view": None})
    assert response is not None
    assert response.status_code == 503
    assert response.data["error"]["code"] == "database_unavailable"
