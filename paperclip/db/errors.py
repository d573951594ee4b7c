"""Which database errors mean the connection itself failed or was lost."""

from __future__ import annotations

import psycopg
from django import db


def connection_lost(exc: BaseException | None) -> bool:
    """The connection to PostgreSQL failed or was lost (a restart, a failover, a terminated
    backend, no primary to connect to): Django's OperationalError / InterfaceError, or
    psycopg's own (raised outside Django's wrapper, or the cause of a Procrastinate
    ConnectorException; a pool that cannot connect raises PoolTimeout, an OperationalError).
    Lock timeouts are OperationalErrors too: callers that take locks turn those into
    `resource_busy` first."""
    lost = (db.OperationalError, db.InterfaceError, psycopg.OperationalError)
    return isinstance(exc, (*lost, psycopg.InterfaceError))
