"""Runtime-lease claim throughput: service and HTTP paths against two baselines.

Run with `make bench` (or `.venv/bin/python bench/leases.py`). Not part of the test suite.

It creates a throwaway database (`paperclip_bench`, or $PAPERCLIP_BENCH_DB) on the server of
$DATABASE_URL (default postgres://postgres@127.0.0.1:5432/postgres), migrates it, measures,
and drops it at the end, also on failure. Single client, sequential requests, in one run:

- raw psycopg: `INSERT ... ON CONFLICT ... DO UPDATE` in its own transaction on an equivalent
  table (the floor: one statement, no framework);
  both tables start with 10,000 leases of other agents (a table of realistic size to plan on);
- straightforward ORM: `select_for_update()` + `update_or_create()` in `atomic()`;
- `leases.services.runtime_lease_claim`, created and renewed paths (agent owner), and a
  renew by an issue owner naming its run too (the fast path judges both);
- HTTP `POST /api/execution-workspaces/{id}/runtime-lease/claim` on a live gunicorn
  (gthread, keep-alive, persistent DB connections), created and renewed paths.

The paths take turns in ten interleaved rounds, so load from elsewhere on the machine hits
them alike (on a server running with autovacuum off, the bench stands in for it between rounds,
at autovacuum's own cadence: tests.support.servers.AutovacuumStandIn); the report prints
ops/s, ratios to the baselines, the three targets, and where
an HTTP renew's time goes (GET /healthz and GET /api/me on the same server as floors).

Options: --iterations N (default 2000 per path), --keep-db;
BENCH_GUNICORN_WORKER_CLASS (default gthread).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.servers import (  # noqa: E402 - after the path setup
    AutovacuumStandIn,
    free_port,
    stop_process,
    throwaway_database,
    wait_for_server,
)

WARMUP = 100
BACKGROUND = 10_000  # leases other agents hold, in both lease tables
ROUNDS = 10


def log(message: str) -> None:
    print(message, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--keep-db", action="store_true")
    parser.add_argument("--quick", action="store_true", help="20 iterations: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.iterations = 20
    n = args.iterations
    server_url = os.environ.get("DATABASE_URL") or "postgres://postgres@127.0.0.1:5432/postgres"
    name = os.environ.get("PAPERCLIP_BENCH_DB", "paperclip_bench")
    with throwaway_database(server_url, name, keep=args.keep_db, log=log) as bench_url:
        return run(bench_url, n)


def run(bench_url: str, n: int) -> int:
    os.environ["DATABASE_URL"] = bench_url
    os.environ["DJANGO_SETTINGS_MODULE"] = "paperclip.settings"
    # A bench is neither manage.py nor pytest: give it (and its gunicorn) a throwaway key.
    os.environ.setdefault("DJANGO_SECRET_KEY", "bench-only")
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection

    from leases.models import WorkspaceRuntimeLease
    from paperclip.credentials import agent_key_create
    from paperclip.models import ActivityEvent, ExecutionWorkspace

    log("migrating ...")
    call_command("migrate", verbosity=0)
    data = seed(WARMUP + n)
    raw = RawUpserts(bench_url, data)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")  # plan as production would, with statistics
    secret = agent_key_create(agent_id=data.agent.pk).secret
    port = free_port()
    server = start_gunicorn(bench_url, port)
    try:
        http = HttpClient(wait_for_server(port, server), secret)
        vacuum = AutovacuumStandIn(
            bench_url,
            (
                WorkspaceRuntimeLease._meta.db_table,
                "bench_raw_leases",
                ExecutionWorkspace._meta.db_table,
                ActivityEvent._meta.db_table,
            ),
            log=log,
        )
        results = measure_interleaved(bench_paths(data, raw, http), n, between=vacuum.due)
        if vacuum.active:
            log(f"(the bench vacuumed the tables {vacuum.runs} times between rounds)")
        http.conn.close()
    finally:
        stop_process(server)
        raw.close()
        connection.close()
    return report(results)


@dataclass
class Seeded:
    """The bench's company, agent and workspaces: fresh ones per path (each created path takes
    the next) and one per path to renew, plus an issue owner's."""

    company: Any
    agent: Any
    fresh: dict[str, Iterator[Any]]
    renew_ws: dict[str, Any]
    owner: Any
    issue_ws: Any
    issue_owner: Any
    others: Any
    agent_key: str  # the agent's owner key, as the lease rows store it


def seed(total: int) -> Seeded:
    from django.utils import timezone

    from leases.models import WorkspaceRuntimeLease
    from leases.services import RuntimeLeaseOwner
    from paperclip.models import Agent, Company, ExecutionWorkspace, HeartbeatRun, Issue

    company = Company.objects.create(name="bench")
    agent = Agent.objects.create(company=company, name="bench-agent")
    log(f"creating {4 * total + 5} workspaces ...")
    fresh = {
        key: iter(
            ExecutionWorkspace.objects.bulk_create(
                ExecutionWorkspace(company=company, name=f"{key}-{i}") for i in range(total)
            )
        )
        for key in ("orm", "svc", "http", "raw")
    }
    renew_ws = {
        key: ExecutionWorkspace.objects.create(company=company, name=f"{key}-renew")
        for key in ("orm", "svc", "http", "raw")
    }
    owner = RuntimeLeaseOwner.for_agent(agent.pk)
    issue_ws = ExecutionWorkspace.objects.create(company=company, name="svc-issue-renew")
    issue_owner = RuntimeLeaseOwner.for_agent(
        agent.pk,
        issue_id=Issue.objects.create(company=company, title="bench", status="in_progress").pk,
        run_id=HeartbeatRun.objects.create(company=company, agent=agent, status="running").pk,
    )
    # A deployment's lease table is not empty: other agents hold BACKGROUND leases, so every
    # statement is planned (and its prepared plan chosen) on a table of realistic size, not
    # on a nearly empty one that the paths below then grow many times over.
    others = Agent.objects.create(company=company, name="bench-others")
    WorkspaceRuntimeLease.objects.bulk_create(
        WorkspaceRuntimeLease(
            company=company,
            execution_workspace=workspace,
            owner_key=f"agent:{others.pk}",
            owner_agent=others,
            last_action="start",
            expires_at=timezone.now() + timedelta(minutes=30),
        )
        for workspace in ExecutionWorkspace.objects.bulk_create(
            ExecutionWorkspace(company=company, name=f"other-{i}") for i in range(BACKGROUND)
        )
    )
    return Seeded(
        company, agent, fresh, renew_ws, owner, issue_ws, issue_owner, others, f"agent:{agent.pk}"
    )


RAW_UPSERT = (
    "INSERT INTO bench_raw_leases VALUES (%s, %s, %s, %s, %s, %s, 1, now(), now(),"
    " now() + interval '30 minutes', NULL, now(), now())"
    " ON CONFLICT (execution_workspace_id) DO UPDATE SET renewed_at = now(),"
    " expires_at = excluded.expires_at, last_action = excluded.last_action,"
    " updated_at = now() RETURNING id, generation, expires_at"
)


class RawUpserts:
    """The raw psycopg baseline: the same columns, no framework, on a table that starts with
    the same BACKGROUND leases of other agents."""

    def __init__(self, bench_url: str, data: Seeded) -> None:
        # The row's constant columns, read once (as the other paths' closures do).
        self.row = (data.company.pk, data.agent_key, data.agent.pk)
        self.conn = psycopg.connect(bench_url, autocommit=True)
        self.conn.execute(
            "CREATE TABLE bench_raw_leases (id uuid PRIMARY KEY, company_id uuid NOT NULL,"
            " execution_workspace_id uuid NOT NULL UNIQUE, owner_key text NOT NULL,"
            " owner_agent_id uuid, last_action text NOT NULL, generation bigint NOT NULL,"
            " claimed_at timestamptz NOT NULL, renewed_at timestamptz NOT NULL,"
            " expires_at timestamptz NOT NULL, metadata jsonb,"
            " created_at timestamptz NOT NULL, updated_at timestamptz NOT NULL)"
        )
        self.conn.execute(
            "INSERT INTO bench_raw_leases SELECT gen_random_uuid(), %s, gen_random_uuid(), %s,"
            " %s, 'start', 1, now(), now(), now() + interval '30 minutes', NULL, now(), now()"
            " FROM generate_series(1, %s)",
            (data.company.pk, f"agent:{data.others.pk}", data.others.pk, BACKGROUND),
        )

    def claim(self, workspace: Any) -> None:
        company_id, agent_key, agent_id = self.row
        with self.conn.transaction():
            self.conn.execute(
                RAW_UPSERT, (uuid.uuid4(), company_id, workspace.pk, agent_key, agent_id, "start")
            ).fetchone()

    def close(self) -> None:
        self.conn.close()


def orm_claimer(data: Seeded) -> Callable[[Any], None]:
    """The straightforward ORM baseline: `select_for_update()` + `update_or_create()`."""
    from django.db import transaction
    from django.utils import timezone

    from leases.models import WorkspaceRuntimeLease

    company_id, agent_key, agent_id = data.company.pk, data.agent_key, data.agent.pk

    def orm_op(workspace: Any) -> None:
        with transaction.atomic():
            list(
                WorkspaceRuntimeLease.objects.select_for_update().filter(
                    execution_workspace_id=workspace.pk
                )
            )
            WorkspaceRuntimeLease.objects.update_or_create(
                execution_workspace_id=workspace.pk,
                defaults={
                    "company_id": company_id,
                    "owner_key": agent_key,
                    "owner_agent_id": agent_id,
                    "last_action": "start",
                    "renewed_at": timezone.now(),
                    "expires_at": timezone.now() + timedelta(minutes=30),
                },
            )

    return orm_op


def service_claimer(data: Seeded) -> Callable[..., None]:
    """The service, `runtime_lease_claim`, asserting the outcome it should answer."""
    from leases.services import RuntimeLeaseOwner, runtime_lease_claim

    company_id = data.company.pk

    def svc(workspace: Any, expect: str, claimant: RuntimeLeaseOwner = data.owner) -> None:
        outcome = runtime_lease_claim(
            company_id=company_id,
            execution_workspace_id=workspace.pk,
            action="start",
            owner=claimant,
        ).outcome
        assert outcome == expect, outcome

    return svc


def start_gunicorn(bench_url: str, port: int) -> subprocess.Popen[bytes]:
    """A live gunicorn: one worker, keep-alive, persistent database connections."""
    worker_class = os.environ.get("BENCH_GUNICORN_WORKER_CLASS", "gthread")
    env = {
        **os.environ,
        "DATABASE_URL": bench_url,
        "DJANGO_CONN_MAX_AGE": "600",  # persistent DB connections, as in production
        "DJANGO_DEBUG": "false",
        "DJANGO_ALLOWED_HOSTS": "127.0.0.1,localhost",
    }
    log(f"starting gunicorn on 127.0.0.1:{port} (1 worker, {worker_class}, keep-alive) ...")
    return subprocess.Popen(
        [
            str(Path(sys.executable).with_name("gunicorn")),
            "paperclip.wsgi:application",
            "--bind",
            f"127.0.0.1:{port}",
            "--workers",
            "1",
            "--worker-class",
            worker_class,
            "--threads",
            "2",
            "--keep-alive",
            "30",
            "--log-level",
            "warning",
        ],
        cwd=ROOT,
        env=env,
    )


class HttpClient:
    """The agent's requests on one keep-alive connection."""

    def __init__(self, conn: Any, secret: str) -> None:
        self.conn = conn
        self.headers = {"Authorization": f"Bearer {secret}", "Content-Type": "application/json"}
        self.body = json.dumps({"action": "start"}).encode()

    def claim(self, workspace: Any, expect: str) -> None:
        self.conn.request(
            "POST",
            f"/api/execution-workspaces/{workspace.pk}/runtime-lease/claim",
            body=self.body,
            headers=self.headers,
        )
        response = self.conn.getresponse()
        payload = json.loads(response.read())
        assert response.status == 200, payload
        assert payload["outcome"] == expect, payload

    def get(self, path: str) -> None:
        self.conn.request("GET", path, headers=self.headers)
        response = self.conn.getresponse()
        response.read()
        assert response.status == 200, response.status


def bench_paths(
    data: Seeded, raw: RawUpserts, http: HttpClient
) -> list[tuple[str, str, Callable[[], Any]]]:
    """Every measured path (key, label, one operation), after the leases the renewing paths
    renew are created."""
    fresh, renew_ws, issue_ws, issue_owner = (
        data.fresh,
        data.renew_ws,
        data.issue_ws,
        data.issue_owner,
    )
    orm_op, svc = orm_claimer(data), service_claimer(data)
    svc(renew_ws["svc"], "created")
    svc(issue_ws, "created", issue_owner)
    http.claim(renew_ws["http"], "created")
    return [
        ("raw_created", "raw upsert, insert", lambda: raw.claim(next(fresh["raw"]))),
        ("raw_renewed", "raw upsert, update", lambda: raw.claim(renew_ws["raw"])),
        ("orm_created", "ORM, insert", lambda: orm_op(next(fresh["orm"]))),
        ("orm_renewed", "ORM, update", lambda: orm_op(renew_ws["orm"])),
        ("svc_created", "service, created", lambda: svc(next(fresh["svc"]), "created")),
        ("svc_renewed", "service, renewed", lambda: svc(renew_ws["svc"], "renewed")),
        (
            "svc_issue_renewed",
            "service, renewed (issue+run)",
            lambda: svc(issue_ws, "renewed", issue_owner),
        ),
        (
            "http_created",
            "HTTP claim, created",
            lambda: http.claim(next(fresh["http"]), "created"),
        ),
        (
            "http_renewed",
            "HTTP claim, renewed",
            lambda: http.claim(renew_ws["http"], "renewed"),
        ),
        # Reference points on the same server, for "where the time goes".
        ("http_me", "HTTP GET /api/me (auth only)", lambda: http.get("/api/me")),
        ("http_healthz", "HTTP GET /healthz (no DRF)", lambda: http.get("/healthz")),
    ]


def measure_interleaved(
    paths: list[tuple[str, str, Callable[[], Any]]],
    n: int,
    rounds: int = ROUNDS,
    *,
    between: Callable[[], None] = lambda: None,
) -> dict[str, float]:
    """ops/s per path. The paths take turns in `rounds` slices of n/rounds operations, so a
    burst of load from elsewhere on the machine hits every path alike (the ratios are what
    matter); the first WARMUP operations of each path are not timed. `between` runs after each
    round, untimed (the autovacuum stand-in)."""
    log(f"warming up ({WARMUP} ops per path) ...")
    for _, _, op in paths:
        for _ in range(WARMUP):
            op()
    elapsed = dict.fromkeys((key for key, _, _ in paths), 0.0)
    done = dict.fromkeys(elapsed, 0)
    per_round = max(1, n // rounds)
    for number in range(rounds):
        for key, _, op in paths:
            count = per_round if number < rounds - 1 else n - done[key]
            started = time.perf_counter()
            for _ in range(count):
                op()
            elapsed[key] += time.perf_counter() - started
            done[key] += count
        log(f"round {number + 1}/{rounds} done")
        between()
    results = {}
    for key, label, _ in paths:
        results[key] = done[key] / elapsed[key]
        log(f"  {label:<32} {done[key]:>6} ops in {elapsed[key]:6.2f}s = {results[key]:8.0f} ops/s")
    return results


def report(results: dict[str, float]) -> int:
    raw = results["raw_renewed"]
    orm = results["orm_renewed"]
    log("")
    log(f"{'path':<22} {'ops/s':>8} {'x raw upsert':>13} {'x ORM':>8}")
    rows = [
        ("raw upsert insert", "raw_created"),
        ("raw upsert update", "raw_renewed"),
        ("ORM insert", "orm_created"),
        ("ORM update", "orm_renewed"),
        ("service created", "svc_created"),
        ("service renewed", "svc_renewed"),
        ("service renewed, issue", "svc_issue_renewed"),
        ("HTTP created", "http_created"),
        ("HTTP renewed", "http_renewed"),
    ]
    for label, key in rows:
        rate = results[key]
        log(f"{label:<22} {rate:>8.0f} {rate / raw:>12.2f}x {rate / orm:>7.2f}x")
    log("(ratios against the update/renew baselines: raw upsert update, ORM update)")
    log("")
    log("where an HTTP renew's time goes (ms per request, single client):")
    per = {key: 1000 / rate for key, rate in results.items()}
    log(f"  HTTP + Django, no DRF/auth (GET /healthz)      {per['http_healthz']:6.2f}")
    log(
        f"  + DRF and bearer-key auth (GET /api/me)        "
        f"{per['http_me'] - per['http_healthz']:6.2f}"
    )
    log(
        f"  + claim view and service (renew)               "
        f"{per['http_renewed'] - per['http_me']:6.2f}"
        f"   (service alone: {per['svc_renewed']:.2f})"
    )
    log(f"  = HTTP renew                                   {per['http_renewed']:6.2f}")
    targets = [
        ("service renew >= 0.5x raw upsert", results["svc_renewed"] / raw, 0.5),
        ("service renew >= 2x straightforward ORM", results["svc_renewed"] / orm, 2.0),
        ("HTTP claim (renew) >= 0.25x raw upsert", results["http_renewed"] / raw, 0.25),
    ]
    log("")
    for label, ratio, target in targets:
        log(f"{'MET ' if ratio >= target else 'MISSED'} {label}: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
