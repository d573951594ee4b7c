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
import contextlib
import io
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
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

TARGET_RATE = 800  # renews/s with p99 under TARGET_P99_MS, production configuration
TARGET_P99_MS = 50.0
TARGET_ROUND_TRIPS = 2
TARGET_RAW_RATIO = 0.5  # the production server's sustained rate / the raw upsert's
TARGET_SERVER_CPU_US = 600.0  # server CPU per renew at the production server's top kept step
SATURATED_P99_MS = 1000.0
WORKSPACES = 256
DEFAULT_RATES = (200, 400, 600, 800, 1000, 1200, 1400, 1600, 2000)
RAW_RATES = (400, 800, 1600, 2400, 3200, 4800, 6400)
# Batch mode: renewals/s (each request or statement carries --batch of them).
TARGET_BATCH_RATE = 10_000
TARGET_BATCH_RAW_RATIO = 0.5
BATCH_RATES = (2000, 4000, 6000, 8000, 10_000, 12_000, 15_000, 20_000, 25_000)
RAW_BATCH_RATES = (4000, 8000, 12_000, 16_000, 20_000, 25_000, 30_000, 40_000, 50_000)
BATCH_LEASES = 2000
BATCH_RAW = "raw psycopg batched upsert"
BATCH_SERVER = "production, batch renew"


def log(message: str) -> None:
    print(message, flush=True)


@dataclass
class Step:
    """One rate of the ladder: what was scheduled and what came back."""

    rate: int
    duration: float
    latencies: list[float] = field(default_factory=list)  # seconds, from the scheduled time
    errors: int = 0
    first_error: str | None = None
    elapsed: float = 0.0
    generator_cpu: float = 0.0
    server_cpu: float = 0.0  # the server's processes, seconds
    database_cpu: float = 0.0  # the PostgreSQL backends serving them, seconds
    new_sessions: int = 0  # database sessions opened during the step
    per_request: int = 1  # renewals per request (batch mode)

    def error(self, text: str) -> None:
        self.errors += 1
        if self.first_error is None:
            self.first_error = text

    @property
    def achieved(self) -> float:
        return len(self.latencies) / self.elapsed if self.elapsed else 0.0

    def quantile_ms(self, q: float) -> float:
        if not self.latencies:
            return float("inf")
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

    @property
    def sustained(self) -> bool:
        """Every request answered correctly, p99 under the target, and the rate was kept
        (a generator or server that fell behind would finish late)."""
        return (
            self.errors == 0
            and self.quantile_ms(0.99) < TARGET_P99_MS
            and self.achieved >= 0.95 * self.rate
        )

    @property
    def saturated(self) -> bool:
        return self.errors > 0 or self.quantile_ms(0.99) > SATURATED_P99_MS

    def cpu_us(self, seconds: float) -> float:
        """CPU microseconds per request answered."""
        return seconds / max(1, len(self.latencies) + self.errors) * 1e6

    @property
    def renewals(self) -> int:
        """The step's rate in renewals/s."""
        return self.rate * self.per_request

    def line(self) -> str:
        unit = f" x{self.per_request}" if self.per_request > 1 else ""
        text = (
            f"  {self.rate:>5}/s{unit}  achieved {self.achieved:7.0f}/s"
            f"  p50 {self.quantile_ms(0.5):8.1f}  p99 {self.quantile_ms(0.99):8.1f}"
            f"  max {self.quantile_ms(1.0):8.1f} ms  errors {self.errors:>4}"
            f"  CPU/request: server {self.cpu_us(self.server_cpu):4.0f} us,"
            f" PostgreSQL {self.cpu_us(self.database_cpu):4.0f} us,"
            f" generator {self.cpu_us(self.generator_cpu):4.0f} us;"
            f" new database sessions {self.new_sessions}"
        )
        if self.first_error:
            text += f"  first error: {self.first_error[:120]}"
        return text


type Send = Callable[[int], Awaitable[None]]


async def open_loop(
    rate: int, duration: float, connections: int, make_sender: Callable[[], Awaitable[Send]]
) -> Step:
    """Run `rate` requests/s for `duration` s over `connections` senders; request i is due at
    t0 + i/rate and its latency counts from then, whether or not a sender was free."""
    step = Step(rate=rate, duration=duration)
    senders = [await make_sender() for _ in range(connections)]
    total = int(rate * duration)
    next_index = 0
    loop = asyncio.get_running_loop()
    t0 = loop.time() + 0.05
    cpu0 = time.process_time()

    async def drive(send: Send) -> None:
        nonlocal next_index
        while next_index < total:
            index = next_index
            next_index += 1
            due = t0 + index / rate
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            try:
                await send(index)
            except Exception as exc:
                step.error(f"{type(exc).__name__}: {exc}")
                continue
            step.latencies.append(loop.time() - due)

    await asyncio.gather(*(drive(send) for send in senders))
    step.elapsed = loop.time() - t0
    step.generator_cpu = time.process_time() - cpu0
    return step


class HttpSender:
    """One keep-alive HTTP/1.1 connection sending prebuilt renew requests (the generator's
    own cost stays small: no client library, a status check and one substring per answer)."""

    def __init__(self, port: int, requests: list[bytes], *, batch: bool = False) -> None:
        self.port = port
        self.requests = requests
        self.batch = batch
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)

    async def send(self, index: int) -> None:
        if self.writer is None or self.reader is None:
            await self.connect()
        assert self.reader is not None
        assert self.writer is not None
        try:
            self.writer.write(self.requests[index % len(self.requests)])
            head = await self.reader.readuntil(b"\r\n\r\n")
            match = re.search(rb"(?i)\r\ncontent-length:\s*(\d+)", head)
            body = await self.reader.readexactly(int(match.group(1))) if match else b""
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            self.writer.close()
            self.reader = self.writer = None
            raise
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(head.split(b"\r\n", 1)[0].decode() + " " + body[:200].decode())
        if self.batch:
            if b'"ok":false' in body or b'"ok":true' not in body:
                raise RuntimeError(f"not renewed: {body[:200].decode()}")
        elif b'"outcome":"renewed"' not in body:
            raise RuntimeError(f"not renewed: {body[:200].decode()}")


# ------------------------------------------------------------------------------------------
# servers


@dataclass(frozen=True)
class ServerConfig:
    name: str
    describe: str
    command: Callable[[int], list[str]]
    env: dict[str, str] = field(default_factory=dict)


def _gunicorn(workers: int, threads: int) -> Callable[[int], list[str]]:
    def command(port: int) -> list[str]:
        return [
            str(Path(sys.executable).with_name("gunicorn")),
            "paperclip.wsgi:application",
            f"--bind=127.0.0.1:{port}",
            f"--workers={workers}",
            "--worker-class=gthread",
            f"--threads={threads}",
            "--keep-alive=30",
            "--log-level=warning",
        ]

    return command


def _granian(workers: int | None, threads: int | None) -> Callable[[int], list[str]]:
    def command(port: int) -> list[str]:
        from paperclip import serve

        return serve.command(bind=f"127.0.0.1:{port}", workers=workers, threads=threads)

    return command


# A configuration's slower path, kept as a comparison: `<configuration>-drf` serves every
# claim through the DRF view, the path without the lean view (leases/api/lean.py).
VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    "-drf": (
        "every claim through the DRF view (PAPERCLIP_LEAN_CLAIM_VIEW=false)",
        {"PAPERCLIP_LEAN_CLAIM_VIEW": "false"},
    ),
}


def server_config(name: str) -> ServerConfig:
    """`production` (python -m paperclip.serve as shipped), `granian-WxT` or `gunicorn-WxT`
    (W workers x T threads); any of them with a suffix of VARIANTS (`-drf`)."""
    for suffix, (describe, env) in VARIANTS.items():
        if name.endswith(suffix):
            base = server_config(name.removesuffix(suffix))
            return ServerConfig(
                name, f"{base.describe}; {describe}", base.command, {**base.env, **env}
            )
    if name == "production":
        return ServerConfig(name, "python -m paperclip.serve, as shipped", _granian(None, None))
    match = re.fullmatch(r"(granian|gunicorn)-(\d+)x(\d+)", name)
    if match is None:
        raise SystemExit(f"unknown server {name!r}: production, granian-WxT or gunicorn-WxT")
    kind, workers, threads = match.group(1), int(match.group(2)), int(match.group(3))
    build = _granian if kind == "granian" else _gunicorn
    label = "granian" if kind == "granian" else "gunicorn gthread"
    return ServerConfig(
        name, f"{label}, {workers} workers x {threads} threads", build(workers, threads)
    )


def start_server(
    config: ServerConfig, port: int, env: dict[str, str], logfile: Path
) -> subprocess.Popen[bytes]:
    with logfile.open("ab") as out:
        return subprocess.Popen(
            config.command(port), cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
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


def _cpu_seconds(process: psutil.Process) -> float:
    try:
        times = process.cpu_times()
    except psutil.Error:  # gone since it was listed
        return 0.0
    return float(times.user + times.system)


@dataclass(frozen=True)
class Usage:
    server_cpu: float  # seconds, the server process and its workers
    database_cpu: float  # seconds, the PostgreSQL backends connected to the bench database
    sessions: int  # database sessions opened so far


class UsageProbe:
    """Resource use so far, read between steps: CPU of the server's processes (none for the
    raw baseline) and of the PostgreSQL backends on the bench database (this probe's own
    excepted), and how many database sessions were ever opened on it (a server that opens a
    connection per request would show here)."""

    def __init__(self, bench_url: str, server: subprocess.Popen[bytes] | None) -> None:
        self.database = psycopg.connect(bench_url, autocommit=True)
        self.server = psutil.Process(server.pid) if server is not None else None

    def sample(self) -> Usage:
        sessions = self.database.execute(
            "SELECT sessions FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
        pids = self.database.execute(
            "SELECT pid FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchall()
        database = 0.0
        for (pid,) in pids:
            with contextlib.suppress(psutil.Error):
                database += _cpu_seconds(psutil.Process(pid))
        server = 0.0
        if self.server is not None:
            processes = [self.server, *self.server.children(recursive=True)]
            server = sum(_cpu_seconds(process) for process in processes)
        return Usage(server, database, int(sessions[0]) if sessions else 0)

    def close(self) -> None:
        self.database.close()


def settle(bench_url: str) -> None:
    """Before each configuration: a CHECKPOINT, so that the dirty pages and WAL the previous
    one left behind are written out now rather than during this one's first steps (measured:
    the configuration run first after the raw upsert's ladder saw p99 of 50-100 ms at 400/s
    that the same configuration, run next, did not)."""
    with psycopg.connect(bench_url, autocommit=True) as conn:
        try:
            conn.execute("CHECKPOINT")
        except psycopg.errors.InsufficientPrivilege:
            log("  (no CHECKPOINT: the bench's role may not run it; figures may carry over)")


def http_ladder(
    port: int,
    requests: list[bytes],
    rates: list[int],
    args: argparse.Namespace,
    probe: UsageProbe,
    vacuum: AutovacuumStandIn,
) -> list[Step]:
    async def make_sender() -> Send:
        sender = HttpSender(port, requests)
        await sender.connect()
        return sender.send

    async def ladder() -> list[Step]:
        # Warm-up: the server's threads and their connections, prepared statements, caches.
        await open_loop(200, 2.0, args.connections, make_sender)
        return await climb(rates, args, make_sender, probe, vacuum)

    return asyncio.run(ladder())


async def climb(
    rates: list[int],
    args: argparse.Namespace,
    make_sender: Callable[[], Awaitable[Send]],
    probe: UsageProbe,
    vacuum: AutovacuumStandIn,
    per_request: int = 1,
) -> list[Step]:
    """The ladder: each rate in turn until one saturates; between steps, the autovacuum
    stand-in when it is due."""
    steps = []
    for rate in rates:
        before = probe.sample()
        step = await open_loop(rate, args.duration, args.connections, make_sender)
        step.per_request = per_request
        after = probe.sample()
        step.server_cpu = after.server_cpu - before.server_cpu
        step.database_cpu = after.database_cpu - before.database_cpu
        step.new_sessions = after.sessions - before.sessions
        log(step.line())
        steps.append(step)
        if step.saturated:
            break
        vacuum.due()
        await asyncio.sleep(0.5)
    return steps


def raw_ladder(
    bench_url: str,
    company_id: uuid.UUID,
    agent_id: uuid.UUID,
    rates: list[int],
    args: argparse.Namespace,
    vacuum: AutovacuumStandIn,
) -> list[Step]:
    log("\nraw psycopg upsert (baseline): INSERT ... ON CONFLICT DO UPDATE, autocommit")
    with psycopg.connect(bench_url, autocommit=True) as setup:
        setup.execute(
            "CREATE TABLE bench_raw_leases (id uuid PRIMARY KEY, company_id uuid NOT NULL,"
            " execution_workspace_id uuid NOT NULL UNIQUE, owner_key text NOT NULL,"
            " owner_agent_id uuid, last_action text NOT NULL, generation bigint NOT NULL,"
            " claimed_at timestamptz NOT NULL, renewed_at timestamptz NOT NULL,"
            " expires_at timestamptz NOT NULL, metadata jsonb,"
            " created_at timestamptz NOT NULL, updated_at timestamptz NOT NULL)"
        )
    keys = [uuid.uuid4() for _ in range(WORKSPACES)]
    upsert = (
        "INSERT INTO bench_raw_leases VALUES (%s, %s, %s, %s, %s, %s, 1, now(), now(),"
        " now() + interval '30 minutes', NULL, now(), now())"
        " ON CONFLICT (execution_workspace_id) DO UPDATE SET renewed_at = now(),"
        " expires_at = excluded.expires_at, last_action = excluded.last_action,"
        " updated_at = now() RETURNING id, generation, expires_at"
    )
    owner_key = f"agent:{agent_id}"

    async def make_sender() -> Send:
        conn = await psycopg.AsyncConnection.connect(bench_url, autocommit=True)

        async def send(index: int) -> None:
            key = keys[index % len(keys)]
            cursor = await conn.execute(
                upsert, (uuid.uuid4(), company_id, key, owner_key, agent_id, "start")
            )
            await cursor.fetchone()

        return send

    async def ladder() -> list[Step]:
        await open_loop(200, 1.0, args.connections, make_sender)
        return await climb(rates, args, make_sender, probe, vacuum)

    probe = UsageProbe(bench_url, None)
    try:
        return asyncio.run(ladder())
    finally:
        probe.close()


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


def raw_batch_ladder(
    bench_url: str,
    company_id: uuid.UUID,
    agent_id: uuid.UUID,
    batches: int,
    rates: list[int],
    args: argparse.Namespace,
    vacuum: AutovacuumStandIn,
) -> list[Step]:
    """The batch baseline: the same number of rows per statement, upserted through psycopg
    in one `INSERT ... SELECT FROM unnest(...) ON CONFLICT DO UPDATE` (autocommit), each
    statement a fixed batch of keys (sorted, as the batch renew locks its rows)."""
    size = args.batch
    log(f"\n{BATCH_RAW} (baseline): {size} rows per INSERT ... ON CONFLICT DO UPDATE")
    with psycopg.connect(bench_url, autocommit=True) as setup:
        setup.execute(
            "CREATE TABLE bench_raw_batch_leases (id uuid PRIMARY KEY, company_id uuid NOT NULL,"
            " execution_workspace_id uuid NOT NULL UNIQUE, owner_key text NOT NULL,"
            " owner_agent_id uuid, last_action text NOT NULL, generation bigint NOT NULL,"
            " claimed_at timestamptz NOT NULL, renewed_at timestamptz NOT NULL,"
            " expires_at timestamptz NOT NULL, metadata jsonb,"
            " created_at timestamptz NOT NULL, updated_at timestamptz NOT NULL)"
        )
    keys = [sorted(uuid.uuid4() for _ in range(size)) for _ in range(batches)]
    upsert = (
        "INSERT INTO bench_raw_batch_leases SELECT gen_random_uuid(), %(company)s, k,"
        " %(owner)s, %(agent)s, 'start', 1, now(), now(), now() + interval '30 minutes', NULL,"
        " now(), now() FROM unnest(%(keys)s::uuid[]) AS k"
        " ON CONFLICT (execution_workspace_id) DO UPDATE SET renewed_at = now(),"
        " expires_at = excluded.expires_at, last_action = excluded.last_action,"
        " updated_at = now() RETURNING id, generation, expires_at"
    )
    owner_key = f"agent:{agent_id}"

    async def make_sender() -> Send:
        conn = await psycopg.AsyncConnection.connect(bench_url, autocommit=True)

        async def send(index: int) -> None:
            params = {
                "company": company_id,
                "owner": owner_key,
                "agent": agent_id,
                "keys": keys[index % len(keys)],
            }
            cursor = await conn.execute(upsert, params)
            rows = await cursor.fetchall()
            if len(rows) != size:
                raise RuntimeError(f"upserted {len(rows)} of {size} rows")

        return send

    async def ladder() -> list[Step]:
        await open_loop(max(1, rates[0] // 2), 1.0, args.connections, make_sender)
        return await climb(rates, args, make_sender, probe, vacuum, per_request=size)

    probe = UsageProbe(bench_url, None)
    try:
        return asyncio.run(ladder())
    finally:
        probe.close()


def batch_report(results: dict[str, list[Step]], args: argparse.Namespace) -> None:
    log("")
    log(
        f"batch mode: open loop, {args.connections} connections, {args.duration:.0f} s per rate,"
        f" batches of {args.batch} renewals; latency per request from its scheduled send time"
    )
    log(f"highest renewal rate with p99 < {TARGET_P99_MS:.0f} ms, no errors, the rate kept:")
    best: dict[str, Step | None] = {}
    for name, steps in results.items():
        kept = [step for step in steps if step.sustained]
        top = max(kept, key=lambda step: step.rate) if kept else None
        best[name] = top
        if top is None:
            log(f"  {name:<28} {'none':>12}")
        else:
            log(
                f"  {name:<28} {top.renewals:>8} renewals/s"
                f"  p50 {top.quantile_ms(0.5):6.1f}  p99 {top.quantile_ms(0.99):6.1f} ms"
            )
    server, raw = best.get(BATCH_SERVER), best.get(BATCH_RAW)
    rate = server.renewals if server else 0
    p99 = server.quantile_ms(0.99) if server else float("inf")
    log(
        f"{'MET ' if rate >= TARGET_BATCH_RATE else 'MISSED'} batch renew sustains"
        f" >= {TARGET_BATCH_RATE} renewals/s with p99 < {TARGET_P99_MS:.0f} ms:"
        f" {rate}/s (p99 {p99:.1f} ms)"
    )
    if raw is None:
        log("(not judged: the raw batched upsert sustained no rate in this run)")
        return
    ratio = rate / raw.renewals
    log(
        f"{'MET ' if ratio >= TARGET_BATCH_RAW_RATIO else 'MISSED'} batch renew sustains"
        f" >= {TARGET_BATCH_RAW_RATIO}x the raw batched upsert's rate:"
        f" {ratio:.2f}x ({rate}/{raw.renewals})"
    )


def count_round_trips(workspace_id: uuid.UUID, secret: str, body: bytes) -> float:
    """PostgreSQL round trips of one HTTP renew, from libpq's protocol trace of this
    process's connection while the WSGI handler serves renews in-process (the same URL
    conf, middleware, authentication and view as a server): each `Query` (simple protocol)
    or `Sync` (end of an extended-protocol exchange) sent is one round trip."""
    from django.db import connection

    from paperclip.wsgi import application as app  # what the servers serve

    logging.getLogger("paperclip.request").setLevel(logging.WARNING)  # the servers log theirs

    def renew() -> None:
        environ = {
            "REQUEST_METHOD": "POST",
            "PATH_INFO": f"/api/execution-workspaces/{workspace_id}/runtime-lease/claim",
            "SERVER_NAME": "127.0.0.1",
            "SERVER_PORT": "80",
            "HTTP_HOST": "127.0.0.1",
            "HTTP_AUTHORIZATION": f"Bearer {secret}",
            "CONTENT_TYPE": "application/json",
            "CONTENT_LENGTH": str(len(body)),
            "wsgi.input": io.BytesIO(body),
            "wsgi.url_scheme": "http",
            "wsgi.errors": sys.stderr,
            "SERVER_PROTOCOL": "HTTP/1.1",
        }
        statuses: list[str] = []

        def start_response(status: str, headers: Any, exc_info: Any = None) -> Any:
            statuses.append(status)

        response = app(environ, start_response)
        payload = b"".join(response)
        close = getattr(response, "close", None)
        if close is not None:  # (paperclip.wsgi answers a list, already closed)
            close()
        if statuses != ["200 OK"] or b'"renewed"' not in payload:
            raise RuntimeError(f"renew failed: {statuses} {payload[:200]!r}")

    renew()  # connects, prepares, refreshes last_used_at
    renew()
    count = 20
    with tempfile.TemporaryFile("w+") as trace:
        pgconn = connection.connection.pgconn
        pgconn.trace(trace.fileno())
        try:
            for _ in range(count):
                renew()
        finally:
            pgconn.untrace()
        trace.seek(0)
        sent = [line.rstrip("\n").split("\t") for line in trace if "\tF\t" in line]
    trips = sum(1 for fields in sent if fields[3].strip() in ("Query", "Sync"))
    statements = sorted({fields[3].strip() for fields in sent})
    log(f"round trips per renew: {trips / count:.2f} (messages sent: {', '.join(statements)})")
    return trips / count


RAW = "raw psycopg upsert"


def report(results: dict[str, list[Step]], round_trips: float, args: argparse.Namespace) -> int:
    log("")
    log(
        f"open loop, {args.connections} connections, {args.duration:.0f} s per rate, one agent"
        f" renewing {WORKSPACES} leases; latency from each request's scheduled send time"
    )
    log(f"highest rate with p99 < {TARGET_P99_MS:.0f} ms, no errors, the rate kept:")
    log(f"  {'configuration':<22} {'sustained':>10} {'p50 ms':>7} {'p99 ms':>7}")
    best: dict[str, Step | None] = {}
    for name, steps in results.items():
        kept = [step for step in steps if step.sustained]
        top = max(kept, key=lambda step: step.rate) if kept else None
        best[name] = top
        if top is None:
            log(f"  {name:<22} {'none':>10}")
        else:
            p50, p99 = top.quantile_ms(0.5), top.quantile_ms(0.99)
            log(f"  {name:<22} {top.rate:>8}/s {p50:7.1f} {p99:7.1f}")
    raw = best.get(RAW)
    log("")
    for name, top in best.items():
        if name == RAW or raw is None:
            continue
        rate = top.rate if top else 0
        ratio = rate / raw.rate
        log(f"{name}: ratio {ratio:.2f} to the raw upsert's sustained rate ({rate}/{raw.rate})")
    production = results.get("production")
    server_cpu_us: float | None = None
    if production:
        # Where the time goes: CPU per renew at the production server's last step that kept
        # its rate, and the rate at which that would fill every CPU of the machine.
        step = max(
            (s for s in production if s.achieved >= 0.95 * s.rate),
            key=lambda s: s.rate,
            default=production[0],
        )
        total = step.cpu_us(step.server_cpu + step.database_cpu + step.generator_cpu)
        server_cpu_us = step.cpu_us(step.server_cpu)
        cpus = len(os.sched_getaffinity(0))
        log(
            f"\nwhere a renew's time goes (production, at {step.rate}/s): server"
            f" {step.cpu_us(step.server_cpu):.0f} us"
            f" + PostgreSQL {step.cpu_us(step.database_cpu):.0f} us"
            f" + load generator {step.cpu_us(step.generator_cpu):.0f} us = {total:.0f} us CPU;"
            f" {cpus} CPUs would be full at about {cpus * 1e6 / total:.0f} renews/s"
        )
        if raw is not None:
            log(
                f"  (the raw upsert: PostgreSQL {raw.cpu_us(raw.database_cpu):.0f} us"
                f" + generator {raw.cpu_us(raw.generator_cpu):.0f} us per statement)"
            )
    log("")
    sustained = best.get("production")
    rate = sustained.rate if sustained else 0
    targets: list[tuple[str, bool, str]] = []
    if production:
        targets.append(
            (
                f"production server sustains >= {TARGET_RATE} renews/s"
                f" with p99 < {TARGET_P99_MS:.0f} ms",
                rate >= TARGET_RATE,
                f"{rate}/s",
            )
        )
        label = f"production server sustains >= {TARGET_RAW_RATIO}x the raw upsert's rate"
        if raw is not None:
            ratio = rate / raw.rate
            targets.append((label, ratio >= TARGET_RAW_RATIO, f"{ratio:.2f}x ({rate}/{raw.rate})"))
        else:  # the machine was too busy for the baseline itself: no ratio to judge
            log(f"(not judged: {label}: the raw upsert sustained no rate in this run)")
        if server_cpu_us is not None:
            targets.append(
                (
                    f"server CPU per renew <= {TARGET_SERVER_CPU_US:.0f} us",
                    server_cpu_us <= TARGET_SERVER_CPU_US,
                    f"{server_cpu_us:.0f} us",
                )
            )
    targets.append(
        (
            f"at most {TARGET_ROUND_TRIPS} PostgreSQL round trips per renew",
            round_trips <= TARGET_ROUND_TRIPS,
            f"{round_trips:.2f}",
        )
    )
    for label, met, figure in targets:
        log(f"{'MET ' if met else 'MISSED'} {label}: {figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
