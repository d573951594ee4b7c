"""The database clock: the only clock for TTLs, expiry and timestamps stored inside jsonb.

App servers' clocks drift apart; every decision about time compares with the one clock all
of them share. In SQL, use `now()` (transaction start) or `clock_timestamp()` (after a lock
wait) directly; these helpers are for values Python must hold.
"""

from __future__ import annotations

from datetime import datetime

from django.db import connection
from django.db.models import DateTimeField, Func


def db_now() -> datetime:
    """The database's `now()`: the start time of the current transaction."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        row = cursor.fetchone()
    if row is None:  # pragma: no cover - SELECT now() always returns a row
        raise RuntimeError("SELECT now() returned no row")
    value: datetime = row[0]
    return value


def db_now_iso() -> str:
    """`db_now()` as ISO-8601, for timestamps stored inside jsonb."""
    return db_now().isoformat()


class ClockTimestamp(Func):
    """The database's `clock_timestamp()`: the time the expression is evaluated, so in an
    UPDATE's WHERE it is re-read when PostgreSQL re-checks a row after waiting for its lock
    (`Now()` is the statement's start)."""

    template = "clock_timestamp()"
    output_field = DateTimeField()
