"""Prepared statements for the hot path, and the request's first read standing in for the
connection health check.

Django's cursors bind client-side and never prepare: PostgreSQL parses and plans every
statement afresh. For the two statements of an agent's renew (the credential lookup and the
renew itself) that was a large share of the database's work per request (bench/leases.py,
bench/renew_load.py), so they run through `prepared_cursor()`: server-side binding, each
statement prepared on first use and reused by the session. psycopg prepares here only because
the settings give it a `prepare_threshold` (settings.DATABASES), and drops its prepared
statements itself after a rollback or DDL. Safe for this service: it never runs behind a
transaction-mode pooler (docs/setup.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Self

import psycopg
from django.db import DEFAULT_DB_ALIAS, OperationalError, connection, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.postgresql.psycopg_any import register_tzloader
from django.db.backends.utils import CursorWrapper
from psycopg.pq import Format

_TIMESTAMPTZ_OID = psycopg.adapters.types["timestamptz"].oid


class _PreparingCursor(psycopg.Cursor[Any]):
    """A psycopg cursor that prepares every statement it runs."""

    def execute(
        self,
        query: Any,
        params: Any = None,
        *,
        prepare: bool | None = None,
        binary: bool | None = None,
    ) -> Self:
        return super().execute(query, params, prepare=True, binary=binary)


def _preparing_cursor(db: BaseDatabaseWrapper) -> _PreparingCursor:
    """A new preparing cursor on `db`'s open connection, reading timestamps in its time zone."""
    cursor = _PreparingCursor(db.connection)
    loader = db.connection.adapters.get_loader(_TIMESTAMPTZ_OID, Format.TEXT)
    if getattr(loader, "timezone", None) != db.timezone:
        register_tzloader(db.timezone, cursor)
    return cursor


def prepared_cursor() -> CursorWrapper:
    """A Django cursor (health check, error translation, query logging when enabled) over a
    preparing psycopg cursor: what `connection.cursor()` builds, with the other cursor class."""
    connection.close_if_health_check_failed()
    connection.ensure_connection()
    connection.validate_thread_sharing()
    with connection.wrap_database_errors:
        raw = _preparing_cursor(connection)
    # (django-stubs type these as taking a CursorWrapper; they wrap a DB-API cursor.)
    if connection.queries_logged:
        return connection.make_debug_cursor(raw)  # type: ignore[arg-type]
    return connection.make_cursor(raw)  # type: ignore[arg-type]


def prepared_fetchone(
    sql: str, params: Sequence[Any] | Mapping[str, Any]
) -> tuple[Any, ...] | None:
    """Run `sql` as a prepared statement on this thread's connection and return its first row.

    What `prepared_cursor()` does, minus building a cursor per statement: the connection keeps
    one preparing cursor for this (building a psycopg cursor and Django's wrapper around it
    twice per renew cost more than the statements' own client side). The connection's health
    check, broken-transaction check and error translation are Django's, as on any cursor. When
    queries are being logged or wrapped (DEBUG, tests capturing queries), it goes through
    `prepared_cursor()` so that they see it.
    """
    db = connections[DEFAULT_DB_ALIAS]
    if db.queries_logged or db.execute_wrappers:
        with prepared_cursor() as cursor:
            cursor.execute(sql, params)
            return cursor.fetchone()
    db.close_if_health_check_failed()
    db.ensure_connection()
    db.validate_thread_sharing()
    db.validate_no_broken_transaction()
    with db.wrap_database_errors:
        raw = db.connection
        kept: tuple[Any, _PreparingCursor] | None = getattr(db, "_paperclip_prepared", None)
        if kept is None or kept[0] is not raw or kept[1].closed:
            kept = (raw, _preparing_cursor(db))
            db._paperclip_prepared = kept  # type: ignore[attr-defined]
        prepared = kept[1]
        prepared.execute(sql, params)
        return prepared.fetchone()


def first_read(sql: str, params: Sequence[Any]) -> tuple[Any, ...] | None:
    """Run a read-only prepared statement as the request's first statement and return its
    first row, with the statement itself as the connection's health check.

    With CONN_HEALTH_CHECKS, Django sends `SELECT 1` before the first statement of every
    request on a reused connection: a round trip of its own, a third of an agent's renew. Here
    the read is sent at once instead; if it fails because the connection turns out to be dead
    (the server restarted, or ended the session, since its last use), the connection is closed
    and the read runs once more on a new one, which is safe because it changes nothing. Any
    other error, or a second failure, propagates (an unreachable database answers 503).
    Inside a transaction there is no retry: the transaction is lost with its connection.
    """
    retry = connection.connection is not None and not connection.in_atomic_block
    if retry:
        connection.health_check_done = True  # type: ignore[attr-defined] # this is the check
    try:
        return prepared_fetchone(sql, params)
    except OperationalError:
        if not retry or connection.connection is None or not connection.connection.closed:
            raise
    connection.close()
    return prepared_fetchone(sql, params)
