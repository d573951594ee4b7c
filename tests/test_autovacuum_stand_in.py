"""The benches' stand-in for autovacuum (tests.support.servers.AutovacuumStandIn): it
vacuums only on a server running without autovacuum, and at most once per naptime."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from django.db import connection

from tests.helpers import raw_connection
from tests.support.processes import database_url
from tests.support.servers import AutovacuumStandIn

pytestmark = pytest.mark.django_db(transaction=True)

TABLE = "autovacuum_stand_in_probe"


def _vacuum_count() -> int:
    """Vacuums of TABLE so far, once the server's statistics have them (the vacuuming session
    reports them when it ends, a moment after the client closed it): polled for up to 5 s."""
    deadline = time.monotonic() + 5
    while True:
        with raw_connection() as conn:
            row = conn.execute(
                "SELECT vacuum_count FROM pg_stat_user_tables WHERE relname = %s", [TABLE]
            ).fetchone()
        count = int(row[0]) if row else 0
        if count or time.monotonic() > deadline:
            return count
        time.sleep(0.05)


@pytest.fixture
def probe_table() -> Iterator[None]:
    """A table of its own (dropped after: a test database outlives its runs)."""
    with connection.cursor() as cursor:
        cursor.execute(f"DROP TABLE IF EXISTS {TABLE}")
        cursor.execute(f"CREATE TABLE {TABLE} (id int)")
    yield
    with connection.cursor() as cursor:
        cursor.execute(f"DROP TABLE {TABLE}")


@pytest.mark.usefixtures("probe_table")
def test_it_vacuums_only_without_autovacuum_and_at_most_once_per_naptime() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('autovacuum')::bool")
        row = cursor.fetchone()
    autovacuum_on = bool(row and row[0])
    messages: list[str] = []
    stand_in = AutovacuumStandIn(database_url(), (TABLE,), log=messages.append)
    assert stand_in.active is not autovacuum_on
    assert bool(messages) is stand_in.active  # it says so when it stands in

    stand_in.due()  # no naptime has passed since it was made
    assert stand_in.runs == 0

    stand_in._last -= stand_in.naptime  # a naptime later
    stand_in.due()
    stand_in.due()  # and at once again: not due yet
    if autovacuum_on:  # the server vacuums; the stand-in never does
        assert stand_in.runs == 0
    else:
        assert stand_in.runs == 1
        assert _vacuum_count() == 1
