"""bench/renew_load.py's load: the open-loop generator, the servers it starts, the CPU probe and
the rate ladders (the server's and the raw psycopg baselines', one renew or one batch a
request). The targets and the report are bench/renew_load_report.py's."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import psycopg

from tests.support.servers import (
    AutovacuumStandIn,
)

ROOT = Path(__file__).resolve().parent.parent

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
