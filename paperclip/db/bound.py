"""Cursors that bind server-side and can read results in binary: bytes travel as bytes.

Django's cursors bind client-side: a bytea parameter is written into the SQL text as a hex
literal (twice its size, then parsed back by PostgreSQL), and results come back as text, a
bytea again as hex. For checkpoint parts (64 KiB and more each) that was most of a write's and
of a read's time (bench/checkpoints.py, docs/performance.md#checkpoint-writes).
`bound_cursor()` is what `connection.cursor()` builds (health check, error translation, query
logging when enabled) over a plain psycopg cursor, which sends parameters apart from the SQL
(bytes in binary); with `binary=True` it asks for results in binary too. Nothing is prepared.
Binary results bypass the time-zone loader Django registers for text results: read no
`timestamptz` through a binary cursor.
"""

from __future__ import annotations

from typing import Any

import psycopg
from django.db import connection
from django.db.backends.utils import CursorWrapper
from psycopg.pq import Format


def bound_cursor(*, binary: bool = False) -> CursorWrapper:
    """A Django cursor over a server-side binding psycopg cursor on this thread's connection."""
    connection.close_if_health_check_failed()
    connection.ensure_connection()
    connection.validate_thread_sharing()
    with connection.wrap_database_errors:
        raw: psycopg.Cursor[Any] = psycopg.Cursor(connection.connection)
        if binary:
            raw.format = Format.BINARY
    # (django-stubs type these as taking a CursorWrapper; they wrap a DB-API cursor.)
    if connection.queries_logged:
        return connection.make_debug_cursor(raw)  # type: ignore[arg-type]
    return connection.make_cursor(raw)  # type: ignore[arg-type]
