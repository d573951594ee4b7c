"""Races on real PostgreSQL connections: the issue execution lock and advisory-lock helpers."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from uuid import UUID

import pytest
from django.db import connection, transaction

from paperclip.access import board_actor
from paperclip.db.advisory import advisory_xact_lock, dedicated_connection, try_advisory_xact_lock
from paperclip.db.locking import busy_on_lock_timeout, set_local_lock_timeout
from paperclip.errors import IssueExecutionLocked, ResourceBusy
from paperclip.locks import issues_for_update, run_lock_with_issue
from paperclip.models import HeartbeatRun, Issue
from paperclip.services import run_transition
from tests.helpers import raw_connection, wait_for_lock_waiters
from tests.paperclip.factories import HeartbeatRunFactory, IssueFactory, UserFactory

pytestmark = pytest.mark.django_db(transaction=True)


def test_only_one_of_four_runs_takes_the_issue() -> None:
    """Four runs start at once, forced: a separate connection holds the issue row (the first
    lock a transition takes), all four are seen queued for it, then it lets go."""
    issue = IssueFactory()
    runs = HeartbeatRunFactory.create_batch(4, company=issue.company, issue=issue, status="queued")
    actor = board_actor(UserFactory(is_superuser=True))

    def attempt(run_id: UUID) -> str:
        try:
            run_transition(actor=actor, run_id=run_id, to_status="running")
            return "won"
        except IssueExecutionLocked:
            return "locked"
        finally:
            connection.close()

    with raw_connection(autocommit=False) as gate:
        gate.execute("SELECT 1 FROM issues WHERE id = %s FOR NO KEY UPDATE", [issue.pk])
        with ThreadPoolExecutor(max_workers=len(runs)) as pool:
            futures = [pool.submit(attempt, r.pk) for r in runs]
            all_waiting = wait_for_lock_waiters(
                len(runs),
                until=lambda: any(f.done() for f in futures),
                holder=gate,
                table="issues",
            )
            gate.rollback()
            outcomes = sorted(f.result(timeout=30) for f in futures)
    assert all_waiting, f"a transition went past the held issue row: {outcomes}"
    assert outcomes == ["locked"] * 3 + ["won"]
    issue.refresh_from_db()
    winner = HeartbeatRun.objects.get(status="running")
    assert issue.execution_run_id == winner.pk == issue.checkout_run_id
    assert HeartbeatRun.objects.filter(status="queued").count() == 3


def _lock_run_briefly(run_id: UUID) -> None:
    # The service's own path with a 200 ms timeout instead of 5 s, to keep the test fast.
    with busy_on_lock_timeout(), transaction.atomic():
        set_local_lock_timeout("200ms")
        run_lock_with_issue(run_id=run_id)


def test_a_locked_issue_row_turns_into_resource_busy() -> None:
    issue = IssueFactory()
    run = HeartbeatRunFactory(company=issue.company, issue=issue, status="queued")
    actor = board_actor(UserFactory(is_superuser=True))
    locked, release = threading.Event(), threading.Event()

    def hold() -> None:
        try:
            with transaction.atomic():
                issues_for_update().filter(pk=issue.pk).get()
                locked.set()
                release.wait(timeout=30)
        finally:
            connection.close()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert locked.wait(timeout=10)
        with pytest.raises(ResourceBusy):
            _lock_run_briefly(run.pk)
    finally:
        release.set()
        holder.join(timeout=10)
    # Once free, the real service goes through.
    run_transition(actor=actor, run_id=run.pk, to_status="running")
    assert Issue.objects.get(pk=issue.pk).execution_run_id == run.pk


def _try_on_dedicated(key: str) -> bool:
    with dedicated_connection() as conn, conn.transaction(), conn.cursor() as cur:
        cur.execute("SELECT pg_try_advisory_xact_lock(hashtextextended(%s, 0))", [key])
        row = cur.fetchone()
        return bool(row and row[0])


def test_try_advisory_lock_is_false_while_another_connection_holds_it() -> None:
    key = "tests:core:advisory"
    with transaction.atomic():
        assert try_advisory_xact_lock(key) is True
        assert _try_on_dedicated(key) is False
        # Re-entrant on the holding connection.
        assert try_advisory_xact_lock(key) is True
    # Freed at commit.
    assert _try_on_dedicated(key) is True


def test_advisory_lock_is_freed_at_rollback() -> None:
    key = "tests:core:rollback"

    class Boom(Exception):
        pass

    def lock_then_fail() -> None:
        with transaction.atomic():
            advisory_xact_lock(key)
            assert _try_on_dedicated(key) is False
            raise Boom

    with pytest.raises(Boom):
        lock_then_fail()
    assert _try_on_dedicated(key) is True


def test_blocking_advisory_lock_waits_for_the_holder() -> None:
    key = "tests:core:blocking"
    held, release, acquired = threading.Event(), threading.Event(), threading.Event()

    def waiter() -> None:
        try:
            held.wait(timeout=10)
            with transaction.atomic():
                advisory_xact_lock(key)
                acquired.set()
        finally:
            connection.close()

    thread = threading.Thread(target=waiter)
    thread.start()
    with dedicated_connection() as conn, conn.transaction(), conn.cursor() as cur:
        cur.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", [key])
        held.set()
        # The waiter is seen queued for the key (not merely slow), and has not got it.
        assert wait_for_lock_waiters(1, until=acquired.is_set)
        assert not acquired.is_set()
        release.set()
    assert acquired.wait(timeout=10)
    thread.join(timeout=10)


def test_advisory_helpers_refuse_to_run_outside_atomic() -> None:
    for fn in (advisory_xact_lock, try_advisory_xact_lock, set_local_lock_timeout):
        with pytest.raises(RuntimeError, match="atomic"):
            fn("tests:core:outside")  # type: ignore[operator]


def test_dedicated_connection_is_separate_from_djangos() -> None:
    issue = IssueFactory(title="before")
    with transaction.atomic():
        Issue.objects.filter(pk=issue.pk).update(title="uncommitted")
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            django_pid = cursor.fetchone()[0]
        with dedicated_connection() as conn, conn.cursor() as cur:
            cur.execute("SELECT pg_backend_pid()")
            assert cur.fetchone()[0] != django_pid
            # Django's uncommitted write is invisible there, and its commit is independent.
            cur.execute("SELECT title FROM issues WHERE id = %s", [issue.pk])
            assert cur.fetchone()[0] == "before"
            conn.commit()
    assert Issue.objects.get(pk=issue.pk).title == "uncommitted"
