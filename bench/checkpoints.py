"""Checkpoint write cost vs stored size, and encrypt/decrypt throughput by part size.

Run with `make bench` (or `.venv/bin/python bench/checkpoints.py`). Not part of the test suite.

It creates a throwaway database (`paperclip_bench_ckpt`, or $PAPERCLIP_BENCH_CKPT_DB) on the
server of $DATABASE_URL (default postgres://postgres@127.0.0.1:5432/postgres), migrates it,
measures, and drops it at the end, also on failure. In one run:

- the time of one fenced `checkpoint_write` that changes one 1 KiB part, for a run that stores
  1 part and for a run that stores 1,000 parts, interleaved so drift hits both alike; the
  ratio (target <= 1.2) shows a write costs what it changes, not what the run stores;
- AES-256-GCM encrypt and decrypt (envelope + binding checks included) of 1 KiB, 64 KiB and
  1 MiB parts.

Options: --iterations N (default 300 writes per path), --keep-db.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_SERVER = "postgres://postgres@127.0.0.1:5432/postgres"


def with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{name}", parts.query, parts.fragment))


def admin_exec(server_url: str, sql: str) -> None:
    with psycopg.connect(with_database(server_url, "postgres"), autocommit=True) as conn:
        conn.execute(sql)


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--keep-db", action="store_true")
    parser.add_argument("--quick", action="store_true", help="10 iterations: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.iterations = 10

    server = os.environ.get("DATABASE_URL") or DEFAULT_SERVER
    db_name = os.environ.get("PAPERCLIP_BENCH_CKPT_DB", "paperclip_bench_ckpt")
    print(f"bench database {db_name} on {urlsplit(server).hostname}:{urlsplit(server).port}")
    admin_exec(server, f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')
    admin_exec(server, f'CREATE DATABASE "{db_name}"')
    try:
        os.environ["DATABASE_URL"] = with_database(server, db_name)
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "paperclip.settings")
        # A bench is neither manage.py nor pytest: give it a throwaway key.
        os.environ.setdefault("DJANGO_SECRET_KEY", "bench-only")
        # A throwaway key: the bench never touches the data directory's key file.
        from checkpoints.crypto import generate_key_text

        os.environ["PAPERCLIP_CHECKPOINT_KEYS"] = generate_key_text()
        import django

        django.setup()
        from django.core.management import call_command

        print("migrating ...", flush=True)
        call_command("migrate", verbosity=0)
        run_bench(args.iterations)
    finally:
        from django.db import connections

        connections.close_all()
        if args.keep_db:
            print(f"kept database {db_name}")
        else:
            admin_exec(server, f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')
    return 0


def run_bench(iterations: int) -> None:
    from checkpoints.crypto import Binding, decrypt_part, encrypt_part, keyring
    from checkpoints.services import (
        CheckpointOwner,
        checkpoint_write,
        controller_lease_acquire,
    )
    from paperclip.models import Agent, Company, HeartbeatRun, Issue, NativeRunFinalization

    company = Company.objects.create(name="bench")
    agent = Agent.objects.create(company=company, name="bench-agent")

    def native_run() -> tuple[HeartbeatRun, CheckpointOwner]:
        issue = Issue.objects.create(company=company, title="bench", status="in_progress")
        run = HeartbeatRun.objects.create(
            company=company,
            agent=agent,
            issue=issue,
            native_issue=issue,
            status="running",
            runtime_mode="native",
        )
        NativeRunFinalization.objects.create(run=run, company=company, issue=issue)
        grant = controller_lease_acquire(
            run_id=run.pk, agent_id=agent.pk, boot_id="bench-boot", ttl_seconds=3600
        )
        owner = CheckpointOwner(
            boot_id="bench-boot", lease_owner=grant.lease_owner, generation=grant.generation
        )
        return run, owner

    def write(run: HeartbeatRun, owner: CheckpointOwner, changed: dict[str, str]) -> None:
        checkpoint_write(
            run_id=run.pk,
            agent_id=agent.pk,
            owner=owner,
            reset=False,
            changed=changed,
            removed=[],
            work_command_ids=["cmd-1"],
            predecessor=None,
        )

    body = "x" * 1024
    small, small_owner = native_run()
    large, large_owner = native_run()
    write(small, small_owner, {"p0": body})
    print("seeding 1,000 parts ...", flush=True)
    for start in range(0, 1000, 250):
        write(large, large_owner, {f"p{i}": body for i in range(start, start + 250)})
    # Warm up both paths (connections, plans, caches) before measuring.
    for _ in range(20):
        write(small, small_owner, {"p0": body})
        write(large, large_owner, {"p0": body})

    small_t: list[float] = []
    large_t: list[float] = []
    for i in range(iterations):
        changed = {"p0": f"{i:08d}" + body[8:]}
        # Alternate the order so neither path always runs first.
        if i % 2:
            small_t.append(timed(lambda c=changed: write(small, small_owner, c)))
            large_t.append(timed(lambda c=changed: write(large, large_owner, c)))
        else:
            large_t.append(timed(lambda c=changed: write(large, large_owner, c)))
            small_t.append(timed(lambda c=changed: write(small, small_owner, c)))

    def ms(values: list[float], q: float) -> float:
        return (
            statistics.quantiles(values, n=100)[int(q) - 1] * 1000
            if q < 100
            else max(values) * 1000
        )

    small_med, large_med = statistics.median(small_t), statistics.median(large_t)
    ratio = large_med / small_med
    print()
    print(f"one changed 1 KiB part per write, {iterations} writes per path")
    print(f"{'stored parts':>12} | {'median ms':>9} | {'p90 ms':>7} | {'writes/s':>8}")
    print(f"{'-' * 12}-+-{'-' * 9}-+-{'-' * 7}-+-{'-' * 8}")
    for label, values, med in (("1", small_t, small_med), ("1,000", large_t, large_med)):
        print(f"{label:>12} | {med * 1000:9.3f} | {ms(values, 90):7.3f} | {1 / med:8.0f}")
    verdict = "OK" if ratio <= 1.2 else "MISSED"
    print(f"ratio 1,000 / 1 (median): {ratio:.3f}  (target <= 1.2: {verdict})")

    print()
    ring = keyring()
    key = ring.primary
    binding = Binding(company.pk, large.native_issue_id, large.pk)  # type: ignore[arg-type]
    header = ("part size", "encrypt MiB/s", "decrypt MiB/s", "enc ops/s", "dec ops/s")
    print(" | ".join(f"{h:>{w}}" for h, w in zip(header, (9, 13, 13, 9, 9), strict=True)))
    print(f"{'-' * 9}-+-{'-' * 13}-+-{'-' * 13}-+-{'-' * 9}-+-{'-' * 9}")
    for label, size in (("1 KiB", 1024), ("64 KiB", 64 * 1024), ("1 MiB", 1024 * 1024)):
        contents = "y" * size
        n = max(20, min(5000, (64 * 1024 * 1024) // size))
        material = encrypt_part(binding, "p", contents, key)
        enc = timed(lambda c=contents, n=n: [encrypt_part(binding, "p", c, key) for _ in range(n)])
        dec = timed(lambda m=material, n=n: [decrypt_part(binding, "p", m, ring) for _ in range(n)])
        mib = n * size / (1024 * 1024)
        print(
            f"{label:>9} | {mib / enc:13.1f} | {mib / dec:13.1f} | {n / enc:9.0f} | {n / dec:9.0f}"
        )


if __name__ == "__main__":
    sys.exit(main())
