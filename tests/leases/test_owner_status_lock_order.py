"""The owner-stale trigger (an issue's status change recomputes the marker of every lease its
key names) locks those lease rows in workspace order, as a batch renew of the same leases
does: in scan order, the two deadlocked and PostgreSQL aborted one (the renew answered 500).

The interleaving is forced with a test-only BEFORE UPDATE trigger that, in the status
change's session only, waits on an advisory lock the test holds once the status change has
locked the lease rows it takes first (a barrier; no product code changes). Found in review,
shown failing first."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest
from django.db import connection

from leases.models import WorkspaceRuntimeLease
from leases.services.batch_renew import RuntimeRenewItem, runtime_leases_renew
from tests.helpers import raw_connection, wait_for_lock_waiters
from tests.leases.factories import claim
from tests.paperclip.factories import (
    AgentFactory,
    CompanyFactory,
    ExecutionWorkspaceFactory,
    IssueFactory,
)

pytestmark = [pytest.mark.django_db(transaction=True)]

KEY = 774411
PROBE_SQL = f"""
CREATE OR REPLACE FUNCTION probe_pause() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('probe.pause', true) = 'on' THEN
        PERFORM pg_advisory_xact_lock({KEY});
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER aaa_probe_pause BEFORE UPDATE ON execution_workspace_runtime_leases
FOR EACH ROW EXECUTE FUNCTION probe_pause();
"""
DROP_SQL = (
    "DROP TRIGGER IF EXISTS aaa_probe_pause ON execution_workspace_runtime_leases;"
    " DROP FUNCTION IF EXISTS probe_pause();"
)


def test_a_batch_renew_and_its_owners_status_change_do_not_deadlock() -> None:
    company = CompanyFactory()
    agent = AgentFactory(company=company)
    issue = IssueFactory(company=company, status="in_progress")
    low, high = sorted(
        ExecutionWorkspaceFactory.create_batch(2, company=company), key=lambda w: w.pk
    )
    claim(high, agent, issue_id=issue.pk)  # inserted first: scanned first
    claim(low, agent, issue_id=issue.pk)
    with raw_connection() as ddl:
        ddl.execute(PROBE_SQL)
    try:

        def status_change() -> str:
            with raw_connection(autocommit=False) as t:
                try:
                    t.execute("SET LOCAL probe.pause = 'on'")
                    t.execute("UPDATE issues SET status = 'done' WHERE id = %s", [issue.pk])
                    t.commit()
                    return "committed"
                except psycopg.Error as exc:
                    return f"{type(exc).__name__}: {exc.sqlstate}"

        def batch_renew() -> object:
            try:
                answers = runtime_leases_renew(
                    company_id=company.pk,
                    agent_id=agent.pk,
                    items=[
                        RuntimeRenewItem(
                            execution_workspace_id=low.pk, generation=1, issue_id=issue.pk
                        ),
                        RuntimeRenewItem(
                            execution_workspace_id=high.pk, generation=1, issue_id=issue.pk
                        ),
                    ],
                )
                return ["renewed" if isinstance(a, str) else a.code for a in answers]
            except Exception as exc:
                return f"{type(exc).__name__}: {getattr(exc.__cause__, 'sqlstate', exc)}"
            finally:
                connection.close()

        with raw_connection(autocommit=False) as gate, ThreadPoolExecutor(2) as pool:
            gate.execute("SELECT pg_advisory_xact_lock(%s)", [KEY])
            changed = pool.submit(status_change)
            wait_for_lock_waiters(1, until=changed.done)  # paused on the barrier
            # Paused once it locked the lease rows it takes first (in scan order, before the
            # fix: the one inserted first, the higher workspace).
            renewed = pool.submit(batch_renew)  # takes the lower workspace's row first
            wait_for_lock_waiters(2, until=renewed.done)
            gate.commit()  # the status change goes on to the low row, held by the renew
            outcomes = {
                "status_change": changed.result(timeout=30),
                "batch_renew": renewed.result(timeout=30),
            }
    finally:
        with raw_connection() as ddl:
            ddl.execute(DROP_SQL)
    print(outcomes)
    # Whatever the order, both finish: the status change commits, and each renew item is
    # answered (renewed, or refused as ineligible), never a deadlock error.
    assert outcomes["status_change"] == "committed", outcomes
    assert isinstance(outcomes["batch_renew"], list), outcomes
    assert WorkspaceRuntimeLease.objects.count() == 2
