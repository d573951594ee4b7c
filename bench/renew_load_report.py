"""bench/renew_load.py's report: the round trips per renew, the tables of sustained rates and
the targets judged (MET / MISSED), for single renews and for batches."""

from __future__ import annotations

import argparse
import io
import logging
import os
import sys
import tempfile
import uuid
from typing import Any

from renew_load_ladder import (
    BATCH_RAW,
    BATCH_SERVER,
    TARGET_BATCH_RATE,
    TARGET_BATCH_RAW_RATIO,
    TARGET_P99_MS,
    TARGET_RATE,
    TARGET_RAW_RATIO,
    TARGET_ROUND_TRIPS,
    TARGET_SERVER_CPU_US,
    WORKSPACES,
    Step,
    log,
)


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
