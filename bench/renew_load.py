"""Renew capacity under open-loop load: the highest sustained renew rate with p99 under 50 ms.

Run with `make bench` (or `.venv/bin/python bench/renew_load.py`). Not part of the test suite.

One agent holds runtime leases on 256 execution workspaces and renews them over HTTP
(`POST /api/execution-workspaces/{id}/runtime-lease/claim`, outcome `renewed`). The load is
open-loop: requests are due on a fixed schedule (rate R: request i at t0 + i/R), spread over
48 keep-alive connections, and each latency is measured from the request's *scheduled* time,
so that a server falling behind shows as queueing delay instead of silently slowing the
generator down (closed-loop benchmarks hide exactly that). Each rate runs for --duration
seconds after a short warm-up; the report gives achieved rate, p50 / p99 / max and errors
(any status but 200, any outcome but `renewed`, any connection error). Rates go up the
ladder until a step saturates (p99 over a second or errors), so every server is taken past
its knee.

In the same run, as the baseline: a raw psycopg `INSERT ... ON CONFLICT DO UPDATE` on an
equivalent table, driven by the same open-loop generator over the same number of
connections (async psycopg, one statement per request, autocommit): what PostgreSQL and
this machine can do with no HTTP and no framework.

Server configurations compared (each started afresh on the same database):

- `production`: what `python -m paperclip.serve` runs (docs/setup.md#serving), the
  configuration the target is judged on;
- `production-drf`: the same server with every claim served by the DRF view
  (PAPERCLIP_LEAN_CLAIM_VIEW=false), the path before leases/api/lean.py, as a comparison;
- `gunicorn-2x4`: gunicorn gthread, 2 workers x 4 threads;
- more with --servers (`granian-WxT`, `gunicorn-WxT`, any of them with `-drf`).

It also counts PostgreSQL round trips per renew, from libpq's own protocol trace of the
server process's connection (in-process calls of the WSGI application the servers serve): every
`Query` or `Sync` message the client sends is one round trip.

The load generator shares the 2-core machine with the server and PostgreSQL, as in the
figures of docs/performance.md; its own CPU use per request is printed so that its share is
visible.

**Batch mode** (`--modes batch`, run by default after the single renews): the same agent renews
--batch-leases runtime leases through `POST /api/leases/renew` in batches of --batch (50)
items, open loop, each request a fixed batch of the leases (the batches never overlap), against
the production server; rates are renewals/s (--batch-rates), latency is per request. Its
baseline, in the same run, is a raw batched upsert of the same number of rows per statement
through psycopg (`INSERT ... SELECT FROM unnest(...) ON CONFLICT DO UPDATE`, autocommit), under
the same generator: it prints both sustained renewal rates, their p99 and the ratio.

Options: --rates 200,400,... --duration S --connections N --servers a,b --modes single,batch
--batch 50 --batch-leases N --batch-rates 2000,4000,... --quick --keep-db.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # before bench/ (the script's folder, where renew_load_*.py are)

from renew_load_ladder import (  # noqa: E402
    BATCH_LEASES,
    BATCH_RATES,
    BATCH_RAW,
    BATCH_SERVER,
    DEFAULT_RATES,
    RAW_BATCH_RATES,
    RAW_RATES,
    WORKSPACES,
    HttpSender,
    Send,
    Step,
    UsageProbe,
    climb,
    http_ladder,
    log,
    open_loop,
    raw_batch_ladder,
    raw_ladder,
    server_config,
    settle,
    start_server,
)
from renew_load_report import batch_report, count_round_trips, report  # noqa: E402

from tests.support.servers import (  # noqa: E402 - after the path setup
    AutovacuumStandIn,
    free_port,
    stop_process,
    throwaway_database,
    wait_for_server,
)

# ------------------------------------------------------------------------------------------
# the run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default=",".join(map(str, DEFAULT_RATES)))
    parser.add_argument("--raw-rates", default=",".join(map(str, RAW_RATES)))
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per rate")
    parser.add_argument("--connections", type=int, default=48)
    parser.add_argument(
        "--servers",
        default="production,production-drf,gunicorn-2x4",
        help=(
            "production, granian-WxT, gunicorn-WxT (W workers x T threads), each optionally"
            " with -drf (claims through the DRF view), comma-separated"
        ),
    )
    parser.add_argument(
        "--modes", default="single,batch", help="single (one renew a request), batch, or both"
    )
    parser.add_argument("--batch", type=int, default=50, help="renewals per batch request")
    parser.add_argument("--batch-leases", type=int, default=BATCH_LEASES)
    parser.add_argument("--batch-rates", default=",".join(map(str, BATCH_RATES)))
    parser.add_argument("--raw-batch-rates", default=",".join(map(str, RAW_BATCH_RATES)))
    parser.add_argument("--quick", action="store_true", help="short steps, for the smoke test")
    parser.add_argument("--keep-db", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.duration = 1.0
        args.rates = "100,200"
        args.raw_rates = "200"
        args.connections = 8
        args.servers = "production"
        args.batch_leases = 200
        args.batch_rates = "500,1000"
        args.raw_batch_rates = "1000"
    server_url = os.environ.get("DATABASE_URL") or "postgres://postgres@127.0.0.1:5432/postgres"
    name = os.environ.get("PAPERCLIP_BENCH_LOAD_DB", "paperclip_bench_load")
    with throwaway_database(server_url, name, keep=args.keep_db, log=log) as bench_url:
        return run(bench_url, args)


def run(bench_url: str, args: argparse.Namespace) -> int:
    os.environ["DATABASE_URL"] = bench_url
    os.environ["DJANGO_SETTINGS_MODULE"] = "paperclip.settings"
    os.environ.setdefault("DJANGO_SECRET_KEY", "bench-only")
    os.environ["DJANGO_DEBUG"] = "false"
    os.environ["DJANGO_ALLOWED_HOSTS"] = "127.0.0.1,localhost"
    os.environ["DJANGO_CONN_MAX_AGE"] = "600"
    metrics_dir = tempfile.mkdtemp(prefix="paperclip-bench-metrics-")
    os.environ["PAPERCLIP_METRICS_DIR"] = metrics_dir
    os.environ["PAPERCLIP_METRICS_ENABLED"] = "true"  # as in production: the counters move
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection

    from leases.models import WorkspaceRuntimeLease
    from leases.services import RuntimeLeaseOwner, runtime_lease_claim
    from paperclip.credentials import agent_key_create
    from paperclip.models import Agent, Company, ExecutionWorkspace

    log("migrating ...")
    call_command("migrate", verbosity=0)
    company = Company.objects.create(name="bench")
    agent = Agent.objects.create(company=company, name="bench-agent")
    workspaces = ExecutionWorkspace.objects.bulk_create(
        ExecutionWorkspace(company=company, name=f"ws-{i}")
        for i in range(max(WORKSPACES, args.batch_leases))
    )
    owner = RuntimeLeaseOwner.for_agent(agent.pk)
    for workspace in workspaces:
        runtime_lease_claim(
            company_id=company.pk, execution_workspace_id=workspace.pk, action="start", owner=owner
        )
    secret = agent_key_create(agent_id=agent.pk).secret
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    modes = set(args.modes.split(","))
    env = {**os.environ}
    if "single" in modes:
        vacuum = AutovacuumStandIn(
            bench_url, (WorkspaceRuntimeLease._meta.db_table, "bench_raw_leases"), log=log
        )
        results, round_trips = single_mode(
            bench_url, company.pk, agent.pk, secret, workspaces[:WORKSPACES], args, vacuum, env
        )
        report(results, round_trips, args)
    if "batch" in modes:
        leases = list(
            WorkspaceRuntimeLease.objects.filter(company=company).values_list(
                "execution_workspace_id", "generation"
            )[: args.batch_leases]
        )
        connection.close()
        vacuum = AutovacuumStandIn(
            bench_url, (WorkspaceRuntimeLease._meta.db_table, "bench_raw_batch_leases"), log=log
        )
        batch_results = batch_mode(bench_url, company.pk, agent.pk, secret, leases, args, vacuum)
        batch_report(batch_results, args)
    shutil.rmtree(metrics_dir, ignore_errors=True)
    return 0


def single_mode(
    bench_url: str,
    company_id: uuid.UUID,
    agent_id: uuid.UUID,
    secret: str,
    workspaces: list[Any],
    args: argparse.Namespace,
    vacuum: AutovacuumStandIn,
    env: dict[str, str],
) -> tuple[dict[str, list[Step]], float]:
    """One renew per request (the claim endpoint), every configuration of --servers."""
    from django.db import connection

    body = json.dumps({"action": "start"}).encode()
    requests = [
        (
            f"POST /api/execution-workspaces/{workspace.pk}/runtime-lease/claim HTTP/1.1\r\n"
            "Host: 127.0.0.1\r\n"
            f"Authorization: Bearer {secret}\r\n"
            "Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        + body
        for workspace in workspaces
    ]

    round_trips = count_round_trips(workspaces[0].pk, secret, body)
    connection.close()

    rates = [int(rate) for rate in args.rates.split(",")]
    results: dict[str, list[Step]] = {}
    settle(bench_url)
    results["raw psycopg upsert"] = raw_ladder(
        bench_url, company_id, agent_id, [int(r) for r in args.raw_rates.split(",")], args, vacuum
    )
    with tempfile.TemporaryDirectory(prefix="paperclip-bench-load-") as scratch:
        for key in args.servers.split(","):
            config = server_config(key)
            port = free_port()
            logfile = Path(scratch) / f"{key}.log"
            log(f"\n{config.name}: {config.describe}")
            server = start_server(config, port, {**env, **config.env}, logfile)
            try:
                wait_for_server(port, server).close()
                settle(bench_url)
                probe = UsageProbe(bench_url, server)
                try:
                    results[config.name] = http_ladder(port, requests, rates, args, probe, vacuum)
                finally:
                    probe.close()
            finally:
                stop_process(server)
            tail = logfile.read_text(errors="replace").strip().splitlines()[-5:]
            if any("Traceback" in line or "ERROR" in line for line in tail):
                log("  server log tail:\n    " + "\n    ".join(tail))
    return results, round_trips


def batch_mode(
    bench_url: str,
    company_id: uuid.UUID,
    agent_id: uuid.UUID,
    secret: str,
    leases: list[tuple[uuid.UUID, int]],
    args: argparse.Namespace,
    vacuum: AutovacuumStandIn,
) -> dict[str, list[Step]]:
    """Batches of --batch renewals: the raw batched upsert, then the production server's
    `POST /api/leases/renew`, at the same renewal rates' ladder."""
    size = args.batch
    chunks = [leases[i : i + size] for i in range(0, len(leases) - size + 1, size)]
    if not chunks:
        raise SystemExit(f"--batch-leases {len(leases)} holds no batch of {size}")
    results: dict[str, list[Step]] = {}
    settle(bench_url)
    raw_rates = [max(1, int(r) // size) for r in args.raw_batch_rates.split(",")]
    results[BATCH_RAW] = raw_batch_ladder(
        bench_url, company_id, agent_id, len(chunks), raw_rates, args, vacuum
    )
    requests = []
    for chunk in chunks:
        body = json.dumps(
            {
                "leases": [
                    {"kind": "runtime", "execution_workspace_id": str(ws), "generation": gen}
                    for ws, gen in chunk
                ]
            }
        ).encode()
        requests.append(
            (
                "POST /api/leases/renew HTTP/1.1\r\n"
                "Host: 127.0.0.1\r\n"
                f"Authorization: Bearer {secret}\r\n"
                "Content-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            ).encode()
            + body
        )
    rates = [max(1, int(r) // size) for r in args.batch_rates.split(",")]
    config = server_config("production")
    port = free_port()
    log(f"\n{BATCH_SERVER}: {config.describe}; {len(chunks)} batches of {size} leases")
    with tempfile.TemporaryDirectory(prefix="paperclip-bench-load-") as scratch:
        logfile = Path(scratch) / "batch.log"
        server = start_server(config, port, {**os.environ, **config.env}, logfile)
        try:
            wait_for_server(port, server).close()
            settle(bench_url)
            probe = UsageProbe(bench_url, server)

            async def make_sender() -> Send:
                sender = HttpSender(port, requests, batch=True)
                await sender.connect()
                return sender.send

            async def ladder() -> list[Step]:
                await open_loop(max(1, rates[0] // 2), 2.0, args.connections, make_sender)
                return await climb(rates, args, make_sender, probe, vacuum, per_request=size)

            try:
                results[BATCH_SERVER] = asyncio.run(ladder())
            finally:
                probe.close()
        finally:
            stop_process(server)
        tail = logfile.read_text(errors="replace").strip().splitlines()[-5:]
        if any("Traceback" in line or "ERROR" in line for line in tail):
            log("  server log tail:\n    " + "\n    ".join(tail))
    return results


if __name__ == "__main__":
    sys.exit(main())
