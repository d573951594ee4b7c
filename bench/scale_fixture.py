"""bench/scale.py's data: the rows both databases hold and the growth to the scale fixture
(`INSERT ... SELECT generate_series`, secondary indexes rebuilt after the load)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

COMPANIES = 100
AGENTS = 1000

# Tables the fixture fills; a Seq Scan expected to read SEQ_SCAN_ROWS rows or more of one is
# flagged (below that, reading the table is what the planner rightly prefers).
SEQ_SCAN_ROWS = 5000
BIG_TABLES = frozenset(
    {
        "execution_workspace_runtime_leases",
        "activity_events",
        "heartbeat_runs",
        "issue_recovery_actions",
        "issues",
        "execution_workspaces",
    }
)


@contextmanager
def connection_cursor() -> Iterator[Any]:
    from django.db import connection

    with connection.cursor() as cursor:
        yield cursor


# --- The fixture ----------------------------------------------------------------------------

# Row g of each table derives its ids from g (md5(kind || g)::uuid), so the INSERTs join
# without lookups. Workspace, issue, run and lease g belong to company g % companies
# (companies 0..9 are the staff user's) and to an agent of that company. Owners: 60% of leases
# are held by their issue (in progress), 20% by their run (running), 20% by an agent; 30% of
# issues are done and 70% of runs have ended, so the stale verdict and the filters meet
# realistic mixes. Every lease is live.
_AGENT_OF = (
    f"md5('agent' || ((g % %(companies)s) + {COMPANIES} * ((g / {COMPANIES})"
    f" % {AGENTS // COMPANIES})))::uuid"
)
_COMPANY_OF = "md5('company' || (g % %(companies)s))::uuid"


def load_fixture(first: int, last: int, *, recovery_every: int, companies: int = COMPANIES) -> None:
    """Fixture rows first..last (workspaces, issues, runs and leases; ten activity rows each,
    a recovery action on every `recovery_every`-th issue), spread over the first `companies`
    companies."""
    statements = [
        (
            "INSERT INTO execution_workspaces (id, company_id, mode, strategy_type, name, status,"
            " provider_type, runtime_lease_generation)"
            f" SELECT md5('ws' || g)::uuid, {_COMPANY_OF}, 'shared_workspace', 'local_directory',"
            " 'ws ' || g, 'active', 'local_fs', 1 FROM generate_series(%(first)s, %(last)s) g"
        ),
        (
            "INSERT INTO issues (id, company_id, title, status, assignee_agent_id,"
            " execution_workspace_id, created_at, updated_at)"
            f" SELECT md5('issue' || g)::uuid, {_COMPANY_OF}, 'issue ' || g,"
            " CASE WHEN g % 10 < 6 THEN 'in_progress' WHEN g % 10 = 6 THEN 'todo' ELSE 'done' END,"
            f" {_AGENT_OF}, md5('ws' || g)::uuid, now() - (g % 90) * interval '1 day',"
            " now() - (g % 30) * interval '1 hour' FROM generate_series(%(first)s, %(last)s) g"
        ),
        (
            "INSERT INTO heartbeat_runs (id, company_id, agent_id, issue_id, status, runtime_mode,"
            " execution_workspace_id, created_at, updated_at, started_at, finished_at)"
            f" SELECT md5('run' || g)::uuid, {_COMPANY_OF}, {_AGENT_OF}, md5('issue' || g)::uuid,"
            " CASE WHEN g % 10 IN (6, 7) THEN 'running' WHEN g % 10 = 8 THEN 'queued'"
            " WHEN g % 20 = 1 THEN 'failed' ELSE 'succeeded' END,"
            " CASE WHEN g % 4 = 0 THEN 'native' ELSE 'legacy' END, md5('ws' || g)::uuid,"
            " now() - (g % 90) * interval '1 day', now() - (g % 90) * interval '1 day',"
            " now() - (g % 90) * interval '1 day',"
            " CASE WHEN g % 10 IN (6, 7, 8) THEN NULL ELSE now() - (g % 90) * interval '1 day' END"
            " FROM generate_series(%(first)s, %(last)s) g"
        ),
        (
            "INSERT INTO execution_workspace_runtime_leases (id, company_id,"
            " execution_workspace_id, owner_key, owner_issue_id, owner_run_id, owner_agent_id,"
            " last_action, claimed_at, renewed_at, expires_at, generation)"
            f" SELECT md5('lease' || g)::uuid, {_COMPANY_OF}, md5('ws' || g)::uuid,"
            " CASE WHEN g % 10 < 6 THEN 'issue:' || md5('issue' || g)::uuid"
            " WHEN g % 10 < 8 THEN 'run:' || md5('run' || g)::uuid"
            f" ELSE 'agent:' || {_AGENT_OF} END,"
            " CASE WHEN g % 10 < 6 THEN md5('issue' || g)::uuid END,"
            " CASE WHEN g % 10 IN (6, 7) THEN md5('run' || g)::uuid END,"
            f" {_AGENT_OF}, 'start', now() - interval '2 hours',"
            " now() - (g % 600) * interval '1 second',"
            " now() + interval '20 minutes' + (g % 600) * interval '1 second', 1"
            " FROM generate_series(%(first)s, %(last)s) g"
        ),
        (
            # Ten audit rows per lease: its workspace, issue and run, across 90 days.
            "INSERT INTO activity_events (id, company_id, actor_type, actor_id, action,"
            " entity_type, entity_id, run_id, details, created_at)"
            f" SELECT md5('event' || e)::uuid, {_COMPANY_OF.replace('g %', '(e / 10) %')},"
            " CASE WHEN e % 3 = 0 THEN 'system' ELSE 'agent' END, 'actor ' || (e % 977),"
            " (ARRAY['runtime_lease.created', 'runtime_lease.reclaimed', 'runtime_lease.released',"
            " 'workspace_operation.recorded', 'issue.updated', 'run.status_changed',"
            " 'run.finalization_requested', 'checkpoint.written', 'runtime_lease.swept',"
            " 'issue.created'])[e % 10 + 1],"
            " (ARRAY['execution_workspace', 'execution_workspace', 'execution_workspace',"
            " 'execution_workspace', 'issue', 'heartbeat_run', 'heartbeat_run', 'heartbeat_run',"
            " 'execution_workspace', 'issue'])[e % 10 + 1],"
            " (CASE WHEN e % 10 IN (4, 9) THEN md5('issue' || (e / 10))"
            " WHEN e % 10 IN (5, 6, 7) THEN md5('run' || (e / 10))"
            " ELSE md5('ws' || (e / 10)) END)::uuid::text,"
            " CASE WHEN e % 10 IN (5, 6, 7) THEN md5('run' || (e / 10))::uuid END,"
            " '{}'::jsonb, now() - (e % 7776000) * interval '1 second'"
            " FROM generate_series(%(first)s * 10, %(last)s * 10 + 9) e"
        ),
        (
            # One per `recovery_every` issues (the small database: one each, so that its
            # status filters show a full page too; the growth: one per eleven, 10,000 in all);
            # live ones (15%) on distinct source issues, as the unique index requires.
            "INSERT INTO issue_recovery_actions (id, company_id, source_issue_id, kind, status,"
            " owner_type, owner_agent_id, cause, fingerprint, evidence, next_action,"
            " attempt_count, stale, created_at, updated_at, resolved_at, outcome)"
            f" SELECT md5('recovery' || g)::uuid, {_COMPANY_OF}, md5('issue' || g)::uuid,"
            " (ARRAY['missing_disposition', 'stranded_assigned_issue', 'workspace_validation',"
            " 'active_run_watchdog'])[g / 10 % 4 + 1],"
            " CASE WHEN g / 10 % 20 < 2 THEN 'active' WHEN g / 10 % 20 = 2 THEN 'escalated'"
            " WHEN g / 10 % 20 = 3 THEN 'cancelled' ELSE 'resolved' END,"
            f" 'agent', {_AGENT_OF}, 'cause ' || (g / 10 % 7), md5('fp' || g),"
            " '{}'::jsonb, 'look at it', g % 3, false,"
            " now() - (g % 90) * interval '1 day', now() - (g % 90) * interval '1 day',"
            " CASE WHEN g / 10 % 20 > 3 THEN now() - (g % 90) * interval '1 day' END,"
            " CASE WHEN g / 10 % 20 > 3 THEN 'restored' END"
            " FROM generate_series((%(first)s + %(every)s - 1) / %(every)s * %(every)s,"
            " %(last)s, %(every)s) g"
        ),
    ]
    with connection_cursor() as cursor:
        # Secondary indexes are built once after the load instead of row by row (the primary
        # keys and unique constraints stay).
        cursor.execute(
            "SELECT i.indexname, i.indexdef FROM pg_indexes i WHERE i.tablename = ANY(%s)"
            " AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conname = i.indexname)",
            [list(BIG_TABLES)],
        )
        secondary = cursor.fetchall()
        for index, _ in secondary:
            cursor.execute(f'DROP INDEX "{index}"')
        for sql in statements:
            # `%` is SQL's modulo here; only the named placeholders are parameters.
            sql = sql.replace("%", "%%")
            for name in ("first", "last", "companies", "every"):
                sql = sql.replace(f"%%({name})s", f"%({name})s")
            cursor.execute(
                sql,
                {"first": first, "last": last, "companies": companies, "every": recovery_every},
            )
        for _, definition in secondary:
            cursor.execute(definition)
        # As autovacuum leaves a table: statistics, and a visibility map for index-only scans.
        for table in sorted(BIG_TABLES):
            cursor.execute(f"VACUUM ANALYZE {table}")
        cursor.execute("ANALYZE")


def table_counts() -> str:
    with connection_cursor() as cursor:
        counts = []
        for table in sorted(BIG_TABLES):
            cursor.execute(f"SELECT count(*) FROM {table}")
            counts.append(f"{table} {cursor.fetchone()[0]:,}")
    return ", ".join(counts)


# --- The report -----------------------------------------------------------------------------
