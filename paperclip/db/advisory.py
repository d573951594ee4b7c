"""PostgreSQL advisory locks, in raw SQL, keyed by `hashtextextended(key, 0)`.

Global lock order (a reviewed change to alter): advisory locks first (sorted by key), then rows
of `paperclip`, `leases`, `recovery`, `checkpoints`; ascending pk within a table, parent before
child. The one deliberate long-held lock is the finalization ownership lock, held on a
dedicated connection (see `dedicated_connection`) for the whole finalization.

Only the 64-bit `hashtextextended` scheme is used, everywhere: mixing it with a Python-side hash
would let two processes each hold "the same" lock.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from django.db import DEFAULT_DB_ALIAS, connections


def _require_atomic(using: str, fn: str) -> None:
    if not connections[using].in_atomic_block:
        # Outside atomic() the lock would vanish when the statement's implicit transaction ends.
        raise RuntimeError(f"{fn}() needs an open transaction.atomic()")


def advisory_xact_lock(key: str, *, using: str = DEFAULT_DB_ALIAS) -> None:
    """Block until the transaction-scoped advisory lock for `key` is held."""
    _require_atomic(using, "advisory_xact_lock")
    with connections[using].cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", [key])


def advisory_xact_lock_shared(key: str, *, using: str = DEFAULT_DB_ALIAS) -> None:
    """Block until the transaction-scoped advisory lock for `key` is held in shared mode: any
    number of shared holders together, none beside an exclusive one (`advisory_xact_lock`).
    Read what the lock protects in a later statement: in READ COMMITTED, this statement's own
    snapshot was taken before the wait."""
    _require_atomic(using, "advisory_xact_lock_shared")
    with connections[using].cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock_shared(hashtextextended(%s, 0))", [key])


def try_advisory_xact_lock(key: str, *, using: str = DEFAULT_DB_ALIAS) -> bool:
    """Take the transaction-scoped advisory lock for `key` if free; False when another holds it."""
    _require_atomic(using, "try_advisory_xact_lock")
    with connections[using].cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_xact_lock(hashtextextended(%s, 0))", [key])
        row = cursor.fetchone()
    return bool(row and row[0])


def advisory_lock_held(key: str, *, using: str = DEFAULT_DB_ALIAS) -> bool:
    """Whether any session holds the advisory lock for `key` in this database, read from
    `pg_locks` without taking it (a 64-bit key shows as classid = high, objid = low 32 bits)."""
    with connections[using].cursor() as cursor:
        cursor.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_locks l, (SELECT hashtextextended(%s, 0) AS k) h "
            "WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 "
            "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
            "AND l.classid::bigint = ((h.k >> 32) & 4294967295) "
            "AND l.objid::bigint = (h.k & 4294967295))",
            [key],
        )
        row = cursor.fetchone()
    return bool(row and row[0])


def connection_params(using: str = DEFAULT_DB_ALIAS) -> dict[str, Any]:
    """psycopg connect() keyword arguments for the configured database (test DB included),
    without the Django-only ones (its cursor factory, adaptation context, binding mode)."""
    params = dict(connections[using].get_connection_params())
    for key in ("cursor_factory", "context", "server_side_binding"):
        params.pop(key, None)
    return params


@contextmanager
def dedicated_connection(
    *,
    using: str = DEFAULT_DB_ALIAS,
    autocommit: bool = False,
    application_name: str = "paperclip-dedicated",
) -> Iterator[psycopg.Connection[Any]]:
    """A psycopg connection outside Django's connection handling, closed on exit.

    It is separate from the connection the request uses, so it can keep a lock transaction open
    while ordinary reads and writes commit on the normal connection, even when the application
    itself is limited to one connection.
    """
    params = connection_params(using)
    params["autocommit"] = autocommit
    params["application_name"] = application_name
    # A lock connection whose peer vanished silently (network partition) fails in bounded time
    # rather than block `assert_held()`: the settings' connect timeout, TCP keepalives and user
    # timeout apply to it as to every connection (ignored on Unix sockets, where the kernel
    # reports a dead peer at once).
    conn = psycopg.connect(**params)
    try:
        yield conn
    finally:
        conn.close()
