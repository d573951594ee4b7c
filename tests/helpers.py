"""Assertions and helpers shared by every test package."""

from __future__ import annotations

from io import StringIO
from typing import Any

import psycopg
from django.core.management import call_command

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


def run_jobs(*queues: str) -> str:
    """Run the jobs that are due now with a real in-process Procrastinate worker
    (`manage.py run_worker --once`), by default the finalization queue only; returns its
    output. Needs committed data: use it in transactional tests."""
    args = ["run_worker", "--once"]
    for queue in queues or ("finalization",):
        args += ["--queue", queue]
    out = StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()
