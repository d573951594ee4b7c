"""Cost that stays flat: each hot operation and console page on a small database vs at scale.

Run with `make bench` (or `.venv/bin/python bench/scale.py`). Not part of the test suite.

It creates a throwaway database (`paperclip_bench_scale`, or $PAPERCLIP_BENCH_SCALE_DB) on the
server of $DATABASE_URL (default postgres://postgres@127.0.0.1:5432/postgres), migrates it and
adds the small, near-empty state: 100 companies, 1,000 agents, the bench's own rows (users,
sessions, an agent key, workspaces to claim) and one full first page of every list (1,000
workspaces, issues, runs and leases, 10,000 activity rows, 1,000 recovery actions: both
databases then render the same rows, so a ratio measures what the data's size costs, not the
HTML of 100 rows against none). It copies that database (`CREATE DATABASE ... TEMPLATE`,
suffix `_scale`) and grows the copy to the scale fixture with `INSERT ... SELECT
generate_series` (100,000 workspaces, issues, runs and runtime leases, 1,000,000 activity rows,
10,000 recovery actions; most owners live, the activity spread over companies, entities,
actions and 90 days; secondary indexes dropped during the load and rebuilt after), and
ANALYZEs. Both are dropped at the end, also on failure. Then, in one run:

1. it times each operation on both databases, switching between them every round (so load
   from elsewhere on the machine hits both alike): a runtime-lease claim (created) and renew
   through the service, a renew over HTTP (Django's test client, bearer key), a sweep of 10
   stale leases, the console dashboard (admin index and the attention fragment) and every
   registered admin changelist (first page, default ordering, plus the filters the dashboard
   tiles link to and the obvious first clicks), each page as a board superuser and as a
   staff user scoped to ten companies;
2. it EXPLAINs every statement each operation sent at scale and flags sequential scans over
   the big tables (a target with one is MISSED whatever its time);
3. sweep proportionality: a sweep of 1,000 stale leases vs 10 at scale.

Each figure is the median of --repeats runs after one warm-up; each target is MET when the
scale/small ratio is <= 1.5. Options: --quick (200 and 2,000 leases, 3 repeats: a smoke run
whose ratios mean little), --leases N (scale fixture size; the other tables scale with it),
--base-leases N (the small database's), --repeats N, --keep-db.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from paperclip.testing.servers import throwaway_database  # noqa: E402

TARGET = 1.5
COMPANIES = 100
AGENTS = 1000
# The small database holds one full first page of every list (1,000 leases: 10,000 activity
# rows, 1,000 runs, 1,000 recovery actions), so both databases render the same number of rows
# and a ratio measures what the data's size costs, not the HTML of 100 rows against none.
BASE_LEASES = 1000
# The staff user is a board member of this many companies (and the bench's own): a tenth of
# the scale fixture, and every row of the small database (so its pages there are full too).
STAFF_COMPANIES = 10
STALE_SMALL = 10
STALE_LARGE = 1000
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


def log(message: str) -> None:
    print(message, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--leases", type=int, default=None)
    parser.add_argument("--base-leases", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--keep-db", action="store_true")
    args = parser.parse_args()
    size = args.leases or (2_000 if args.quick else 100_000)
    base = args.base_leases or (200 if args.quick else BASE_LEASES)
    repeats = args.repeats or (3 if args.quick else 7)
    server_url = os.environ.get("DATABASE_URL") or "postgres://postgres@127.0.0.1:5432/postgres"
    name = os.environ.get("PAPERCLIP_BENCH_SCALE_DB", "paperclip_bench_scale")
    started = time.perf_counter()
    with throwaway_database(server_url, name, keep=args.keep_db, log=log) as bench_url:
        code = run(bench_url, f"{name}_scale", base, size, repeats, keep=args.keep_db)
    log(f"bench wall time {time.perf_counter() - started:.0f} s")
    return code


def use_database(name: str) -> None:
    """Point Django's default connection at database `name` (same server and user)."""
    from django.db import connection

    connection.close()
    connection.settings_dict["NAME"] = name


# --- Measuring ------------------------------------------------------------------------------


@dataclass
class Op:
    key: str
    label: str
    run: Callable[[], Any]
    setup: Callable[[], Any] | None = None  # untimed, before each run (e.g. make rows stale)


@dataclass
class Figure:
    median_ms: float
    queries: int
    db_ms: float  # median time in the database round trips


@dataclass
class Plans:
    """What the EXPLAIN pass found for one op, and where its time went in that run."""

    flagged: list[str] = field(default_factory=list)
    statements: int = 0
    elapsed_ms: float = 0.0
    db_ms: float = 0.0  # the statements' round trips
    slowest: tuple[float, str] = (0.0, "")


@contextmanager
def captured() -> Iterator[list[tuple[str, Any, float]]]:
    """Every statement (sql, params, seconds) sent on the default connection in the block."""
    from django.db import connection

    seen: list[tuple[str, Any, float]] = []

    def wrapper(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        started = time.perf_counter()
        try:
            return execute(sql, params, many, context)
        finally:
            seen.append((sql, params, time.perf_counter() - started))

    with connection.execute_wrapper(wrapper):
        yield seen


def run_once(op: Op) -> tuple[float, list[tuple[str, Any, float]]]:
    """Set `op` up, run it once: (seconds it took, the statements it sent with their times)."""
    if op.setup is not None:
        op.setup()
    with captured() as seen:
        started = time.perf_counter()
        op.run()
        elapsed = time.perf_counter() - started
    return elapsed, seen


def measure(ops: list[Op], repeats: int, databases: list[str]) -> dict[str, dict[str, Figure]]:
    """Median wall time per database and op: one warm-up, then `repeats` runs. Each round runs
    every op on each database in turn, so load from elsewhere on the machine hits them alike."""
    times: dict[str, dict[str, list[float]]] = {db: {op.key: [] for op in ops} for db in databases}
    in_db: dict[str, dict[str, list[float]]] = {db: {op.key: [] for op in ops} for db in databases}
    queries: dict[str, dict[str, int]] = {db: {} for db in databases}
    for round_number in range(repeats + 1):
        for db in databases:
            use_database(db)
            for op in ops:
                elapsed, seen = run_once(op)
                if round_number:
                    times[db][op.key].append(elapsed)
                    in_db[db][op.key].append(sum(row[2] for row in seen))
                queries[db][op.key] = len(seen)
    return {
        db: {
            key: Figure(
                statistics.median(values) * 1000,
                queries[db][key],
                statistics.median(in_db[db][key]) * 1000,
            )
            for key, values in times[db].items()
        }
        for db in databases
    }


def explain(ops: list[Op]) -> dict[str, Plans]:
    """EXPLAIN each statement an op sends; flag Seq Scans over the big tables."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT relname, reltuples FROM pg_class WHERE relname = ANY(%s)", [list(BIG_TABLES)]
        )
        sizes = dict(cursor.fetchall())
    found: dict[str, Plans] = {}
    for op in ops:
        elapsed, seen = run_once(op)
        slowest = max(seen, key=lambda row: row[2])
        plans = Plans(
            elapsed_ms=elapsed * 1000,
            db_ms=sum(row[2] for row in seen) * 1000,
            slowest=(slowest[2] * 1000, one_line(slowest[0])),
        )
        for sql, params, _ in seen:
            head = sql.lstrip().split(None, 1)[0].upper()
            if head not in {"SELECT", "WITH", "UPDATE", "DELETE", "INSERT"}:
                continue
            plans.statements += 1
            with connection.cursor() as cursor:
                cursor.execute(f"EXPLAIN (FORMAT JSON) {sql}", params)
                plan = cursor.fetchone()[0]
            if isinstance(plan, str):
                plan = json.loads(plan)
            for node, limit in walk(plan[0]["Plan"]):
                table = node.get("Relation Name")
                if node["Node Type"] != "Seq Scan" or table not in sizes:
                    continue
                # Under a Limit (nothing blocking between) the scan stops once it has found
                # `limit` rows: it reads about limit / selectivity rows, however big the table.
                reads = sizes[table]
                if limit is not None:
                    reads = min(reads, limit * sizes[table] / max(node["Plan Rows"], 1))
                if reads >= SEQ_SCAN_ROWS:
                    where = node.get("Filter", "")
                    line = (
                        f"Seq Scan on {table} (reads~{reads:.0f} rows"
                        f"{', filter ' + where[:80] if where else ''}) in: {one_line(sql)[:160]}"
                    )
                    if line not in plans.flagged:
                        plans.flagged.append(line)
        found[op.key] = plans
    return found


# Nodes that read all their input before returning a row: a Limit above them stops nothing.
_BLOCKING = frozenset({"Sort", "Aggregate", "Hash", "Materialize", "SetOp", "WindowAgg"})


def walk(
    node: dict[str, Any], limit: float | None = None
) -> Iterator[tuple[dict[str, Any], float | None]]:
    """Each plan node with the row limit that stops it early, if any."""
    if node["Node Type"] == "Limit":
        limit = node["Plan Rows"]
    elif node["Node Type"] in _BLOCKING:
        limit = None
    yield node, limit
    for child in node.get("Plans", []):
        yield from walk(child, limit)


def one_line(sql: str) -> str:
    return " ".join(sql.split())


# --- The run --------------------------------------------------------------------------------


def run(bench_url: str, scale_name: str, base: int, size: int, repeats: int, *, keep: bool) -> int:
    os.environ["DATABASE_URL"] = bench_url
    os.environ["DJANGO_SETTINGS_MODULE"] = "paperclip.settings"
    # A bench is neither manage.py nor pytest: give it a throwaway key, and keep its output to
    # the figures (no line per request or audit row).
    os.environ.setdefault("DJANGO_SECRET_KEY", "bench-only")
    os.environ.setdefault("PAPERCLIP_EVENT_LOG_LEVEL", "WARNING")
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection

    log("migrating ...")
    call_command("migrate", verbosity=0)
    bench = Bench.create()
    log(f"loading the small fixture ({base:,} leases) ...")
    # The small database's rows all belong to the staff user's companies, so its pages are as
    # full as the superuser's.
    load_fixture(1, base, companies=STAFF_COMPANIES, recovery_every=1)
    ops = bench.ops()
    small_name = connection.settings_dict["NAME"]
    connection.close()
    template = urlsplit(bench_url).path.lstrip("/")
    with throwaway_database(bench_url, scale_name, keep=keep, log=log, template=template):
        use_database(scale_name)
        log(f"loading the scale fixture (to {size:,} leases) into {scale_name} ...")
        started = time.perf_counter()
        load_fixture(base + 1, size, recovery_every=11)
        load_seconds = time.perf_counter() - started
        log(f"fixture loaded and analyzed in {load_seconds:.0f} s: {table_counts()}")
        log(f"timing {len(ops)} operations, {repeats} repeats on each database ...")
        figures = measure(ops, repeats, [small_name, scale_name])
        plans = explain(ops)
        log("sweep proportionality at scale ...")
        large = measure([bench.sweep_op(STALE_LARGE)], max(2, repeats // 2), [scale_name])
        connection.close()
    small, scale = figures[small_name], figures[scale_name]
    sweep_large = large[scale_name]["sweep"]
    return report(ops, small, scale, plans, scale["sweep"], sweep_large, size, load_seconds)


class Bench:
    """The bench's own rows (present in both phases) and the operations over them."""

    def __init__(self, **rows: Any) -> None:
        self.__dict__.update(rows)

    @classmethod
    def create(cls) -> Bench:
        from django.contrib.auth import get_user_model
        from django.contrib.auth.models import Permission

        from paperclip.credentials import agent_key_create
        from paperclip.models import (
            Agent,
            BoardMembership,
            Company,
            ExecutionWorkspace,
            HeartbeatRun,
        )

        with connection_cursor() as cursor:
            cursor.execute(
                "INSERT INTO companies (id, name) SELECT md5('company' || c)::uuid,"
                " 'company ' || c FROM generate_series(0, %s) c",
                [COMPANIES - 1],
            )
            cursor.execute(
                "INSERT INTO agents (id, company_id, name, status) SELECT md5('agent' || a)::uuid,"
                " md5('company' || (a %% %s))::uuid, 'agent ' || a, 'active'"
                " FROM generate_series(0, %s) a",
                [COMPANIES, AGENTS - 1],
            )
        company = Company.objects.create(name="bench")
        agent = Agent.objects.create(company=company, name="bench-agent")
        # One fresh workspace per claim (warm-up and repeats of both phases, with room).
        fresh = iter(
            ExecutionWorkspace.objects.bulk_create(
                ExecutionWorkspace(company=company, name=f"claim-{i}") for i in range(200)
            )
        )
        renew_ws = ExecutionWorkspace.objects.create(company=company, name="renew")
        http_ws = ExecutionWorkspace.objects.create(company=company, name="http-renew")
        stale_pool = ExecutionWorkspace.objects.bulk_create(
            ExecutionWorkspace(company=company, name=f"stale-{i}") for i in range(STALE_LARGE)
        )
        ended = HeartbeatRun.objects.create(company=company, agent=agent, status="failed")
        user_model = get_user_model()
        board = user_model.objects.create_user(
            username="board", password=None, is_staff=True, is_superuser=True
        )
        staff = user_model.objects.create_user(username="staff", password=None, is_staff=True)
        staff.user_permissions.set(Permission.objects.all())
        for scoped in (
            company,
            *Company.objects.filter(name__in=[f"company {c}" for c in range(STAFF_COMPANIES)]),
        ):
            BoardMembership.objects.create(user=staff, company=scoped)
        return cls(
            company=company,
            agent=agent,
            fresh=fresh,
            renew_ws=renew_ws,
            http_ws=http_ws,
            stale_pool=stale_pool,
            ended=ended,
            board=board,
            staff=staff,
            secret=agent_key_create(agent_id=agent.pk).secret,
        )

    def claim(self, workspace_id: Any, expect: str) -> None:
        from leases.services import RuntimeLeaseOwner, runtime_lease_claim

        outcome = runtime_lease_claim(
            company_id=self.company.pk,
            execution_workspace_id=workspace_id,
            action="start",
            owner=RuntimeLeaseOwner.for_agent(self.agent.pk),
        ).outcome
        assert outcome == expect, outcome

    def make_stale(self, count: int) -> None:
        """`count` stale leases on the bench's pool: half expired, half held by an ended run."""
        from leases.models import WorkspaceRuntimeLease

        pool = self.stale_pool[:count]
        WorkspaceRuntimeLease.objects.filter(execution_workspace__in=pool).delete()
        rows = []
        for i, workspace in enumerate(pool):
            expired = i % 2 == 0
            rows.append(
                WorkspaceRuntimeLease(
                    company=self.company,
                    execution_workspace=workspace,
                    owner_key=f"agent:{self.agent.pk}" if expired else f"run:{self.ended.pk}",
                    owner_agent=self.agent,
                    owner_run=None if expired else self.ended,
                    last_action="start",
                    expires_at=_minutes_from_now(-5 if expired else 30),
                )
            )
        WorkspaceRuntimeLease.objects.bulk_create(rows)

    def sweep_op(self, stale: int) -> Op:
        from leases.services import runtime_lease_sweep

        def sweep() -> None:
            report = runtime_lease_sweep()
            assert report.deleted == stale, (report.deleted, stale)

        return Op("sweep", f"sweep, {stale} stale", sweep, setup=lambda: self.make_stale(stale))

    def ops(self) -> list[Op]:
        from django.contrib import admin
        from django.test import Client
        from django.urls import reverse

        self.claim(self.renew_ws.pk, "created")
        board, staff, agent_client = Client(), Client(), Client()
        board.force_login(self.board)
        staff.force_login(self.staff)
        claim_url = reverse("runtime-lease-claim", args=[self.http_ws.pk])
        auth = {"HTTP_AUTHORIZATION": f"Bearer {self.secret}"}
        body = json.dumps({"action": "start"})
        agent_client.post(claim_url, body, content_type="application/json", **auth)

        def http_renew() -> None:
            response = agent_client.post(claim_url, body, content_type="application/json", **auth)
            assert response.status_code == 200, response.content
            assert response.json()["outcome"] == "renewed", response.content

        ops = [
            Op(
                "claim",
                "claim (created), service",
                lambda: self.claim(next(self.fresh).pk, "created"),
            ),
            Op("renew", "renew, service", lambda: self.claim(self.renew_ws.pk, "renewed")),
            Op("http_renew", "renew, HTTP", http_renew),
            self.sweep_op(STALE_SMALL),
        ]
        pages = [
            ("dashboard", reverse("admin:index")),
            ("attention", reverse("admin:console_attention")),
        ]
        for model in admin.site._registry:
            opts = model._meta
            url = reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist")
            pages.append((f"{opts.app_label}.{opts.model_name}", url))
            for query in _COMMON_FILTERS.get(opts.db_table, ()):
                pages.append((f"{opts.app_label}.{opts.model_name}?{query}", f"{url}?{query}"))
        for who, client in (("board", board), ("staff", staff)):
            for name, url in pages:
                if client is staff and not _staff_may_open(url, client):
                    continue
                ops.append(Op(f"{who}:{name}", f"{name} ({who})", _page(client, url)))
        return ops


# Filters operators use most: the dashboard tiles' links and the obvious first clicks.
_COMMON_FILTERS: dict[str, tuple[str, ...]] = {
    "execution_workspace_runtime_leases": ("staleness=stale", "stale_reason=lease_expired"),
    "activity_events": ("action=runtime_lease.swept", "entity_type=issue"),
    "heartbeat_runs": ("status__exact=running",),
    "issue_recovery_actions": ("status__exact=active", "hold=board"),
    "native_run_finalizations": ("attention=failed",),
}


def _page(client: Any, url: str) -> Callable[[], None]:
    def get() -> None:
        response = client.get(url)
        assert response.status_code == 200, (url, response.status_code)
        response.content  # noqa: B018 (a TemplateResponse renders when read)

    return get


def _staff_may_open(url: str, client: Any) -> bool:
    import logging

    quiet = logging.getLogger("django.request")
    level, quiet.level = quiet.level, logging.ERROR  # the 403s of superuser-only pages
    try:
        return bool(client.get(url).status_code == 200)
    finally:
        quiet.level = level


def _minutes_from_now(minutes: int) -> Any:
    from datetime import timedelta

    from django.utils import timezone

    return timezone.now() + timedelta(minutes=minutes)


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


def report(
    ops: list[Op],
    small: dict[str, Figure],
    scale: dict[str, Figure],
    plans: dict[str, Plans],
    sweep_small: Figure,
    sweep_large: Figure,
    size: int,
    load_seconds: float,
) -> int:
    log("")
    log(f"fixture: {size:,} leases; loaded in {load_seconds:.0f} s")
    log(
        f"{'operation':<58} {'small ms':>9} {'scale ms':>9} {'ratio':>6} {'queries':>8}"
        f" {'in the database, ms':>20}"
    )
    missed = []
    for op in ops:
        before, after = small[op.key], scale[op.key]
        ratio = after.median_ms / before.median_ms
        flagged = plans[op.key].flagged
        verdict = "MET" if ratio <= TARGET and not flagged else "MISSED"
        if verdict == "MISSED":
            missed.append(op.label)
        log(
            f"{verdict:<6} {op.label:<51} {before.median_ms:>9.2f} {after.median_ms:>9.2f}"
            f" {ratio:>5.2f}x {before.queries:>3}->{after.queries:<3}"
            f" {before.db_ms:>9.1f} ->{after.db_ms:>7.1f}"
        )
        for line in flagged:
            log(f"         {line}")
        if verdict == "MISSED":
            plan = plans[op.key]
            log(
                f"         where the time goes (one run at scale): {plan.elapsed_ms:.1f} ms,"
                f" {plan.db_ms:.1f} ms of it in {after.queries} statements; slowest"
                f" {plan.slowest[0]:.1f} ms: {plan.slowest[1][:150]}"
            )
    statements = sum(p.statements for p in plans.values())
    flagged_total = sum(len(p.flagged) for p in plans.values())
    log("")
    log(f"EXPLAIN: {statements} statements checked at scale, {flagged_total} big-table Seq Scans")
    per_small = sweep_small.median_ms / STALE_SMALL
    per_large = sweep_large.median_ms / STALE_LARGE
    growth = sweep_large.median_ms / sweep_small.median_ms
    log(
        f"sweep at scale: {STALE_SMALL} stale {sweep_small.median_ms:.1f} ms"
        f" ({per_small:.2f} ms/row), {STALE_LARGE} stale {sweep_large.median_ms:.1f} ms"
        f" ({per_large:.2f} ms/row): ratio {growth:.1f}x for {STALE_LARGE // STALE_SMALL}x the"
        " stale rows"
    )
    log("")
    total_ratio = max(scale[op.key].median_ms / small[op.key].median_ms for op in ops)
    log(
        f"{'MET ' if not missed else 'MISSED'} every operation within {TARGET}x of the small"
        f" database, no big-table Seq Scan: worst ratio {total_ratio:.2f}x"
        + (f"; missed: {', '.join(missed)}" if missed else "")
    )
    sweep_ratio = scale["sweep"].median_ms / small["sweep"].median_ms
    log(
        f"{'MET ' if sweep_ratio <= TARGET else 'MISSED'} sweep of {STALE_SMALL} stale leases"
        f" costs the same among {size:,} leases as in the small database: {sweep_ratio:.2f}x"
    )
    # Linear in stale rows (with a fixed part) means at most STALE_LARGE / STALE_SMALL.
    log(
        f"{'MET ' if growth <= STALE_LARGE / STALE_SMALL else 'MISSED'} sweep cost grows with"
        f" stale rows, at most linearly: {growth:.1f}x for {STALE_LARGE // STALE_SMALL}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
