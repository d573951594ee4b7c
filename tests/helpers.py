"""Assertions and helpers shared by every test package."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from io import StringIO
from typing import Any

import psycopg
from django.core.management import call_command
from django.test import override_settings
from prometheus_client import REGISTRY

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


LOCK_WAIT_TIMEOUT = 15.0


def wait_for_lock_waiters(
    count: int = 1,
    *,
    until: Callable[[], bool] | None = None,
    holder: psycopg.Connection[Any] | None = None,
    table: str | None = None,
    timeout: float = LOCK_WAIT_TIMEOUT,
) -> bool:
    """Poll until `count` backends of this database wait for a lock at once (bounded). With
    `until`, give up (returning False) as soon as it is true: a would-be waiter finished
    without waiting. This is how a race test proves its contenders overlapped: a separate
    connection holds the contested lock, and every contender is seen queued behind it.

    With `holder` (the connection holding row locks) and `table`, count only the backends
    queued for the rows of `table` that `holder` locked: the first waiter of a row waits for
    the holder's transaction id, later ones for that row's tuple lock. A contender queued
    behind another contender's transaction instead (it went past the held lock and was
    stopped further on, say by a unique index) does not count."""
    if (holder is None) != (table is None):
        raise ValueError("holder and table go together")
    if holder is None:
        sql, params = _ANY_LOCK_WAITERS, {}
    else:
        sql, params = _ROW_LOCK_WAITERS, {"holder": holder.info.backend_pid, "table": table}
    deadline = time.monotonic() + timeout
    with raw_connection() as observer:
        while time.monotonic() < deadline:
            row = observer.execute(sql, params).fetchone()
            if row and row[0] >= count:
                return True
            if until is not None and until():
                return False
            time.sleep(0.01)  # polling an observable state, not a timing assumption
    raise AssertionError(f"fewer than {count} backends started waiting for the lock")


_ANY_LOCK_WAITERS = (
    "SELECT count(*) FROM pg_stat_activity"
    " WHERE datname = current_database() AND wait_event_type = 'Lock'"
)
_ROW_LOCK_WAITERS = (
    "SELECT count(DISTINCT pid) FROM pg_locks WHERE NOT granted AND ("
    " (locktype = 'transactionid' AND transactionid IN (SELECT transactionid FROM pg_locks"
    "  WHERE pid = %(holder)s AND locktype = 'transactionid' AND granted))"
    " OR (locktype = 'tuple' AND database = (SELECT oid FROM pg_database"
    "  WHERE datname = current_database()) AND relation = %(table)s::regclass))"
)


def sample(name: str, **labels: str) -> float:
    """A metric's current value in this process's registry (0 when never set)."""
    return REGISTRY.get_sample_value(name, labels) or 0.0


def each_way(
    setting: str,
    send: Callable[[], None],
    *,
    counters: Callable[[], Sequence[float]],
    request_lines: list[logging.LogRecord],
    on_commit: Any,
) -> tuple[list[tuple[float, ...]], list[list[tuple[str, dict[str, Any]]]]]:
    """`send` run with `setting` True, then False (two paths that must look alike from
    outside): for each, how far `counters` moved and the request log lines written, each as
    its message without the duration and its `http` fields without `duration_ms`.
    `on_commit` is pytest-django's `django_capture_on_commit_callbacks` fixture."""
    deltas: list[tuple[float, ...]] = []
    lines: list[list[tuple[str, dict[str, Any]]]] = []
    for value in (True, False):
        with override_settings(**{setting: value}):
            before = counters()
            with on_commit(execute=True):
                send()
            deltas.append(tuple(a - b for a, b in zip(counters(), before, strict=True)))
        lines.append(
            [
                (
                    record.getMessage().rsplit(" ", 2)[0],
                    {k: v for k, v in record.http.items() if k != "duration_ms"},  # type: ignore[attr-defined]
                )
                for record in request_lines
            ]
        )
        request_lines.clear()
    return deltas, lines


def close_if_dead() -> None:
    """Close this thread's Django connection when its session was ended from outside
    (pg_terminate_backend, as a failover would): the object still looks open, and the next
    query would meet `AdminShutdown`. Outside a transaction only; the next query reconnects."""
    from django.db import connection

    if (
        connection.connection is not None
        and not connection.in_atomic_block
        and not connection.is_usable()
    ):
        connection.close()
