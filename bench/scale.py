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
import os
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # before bench/ (the script's folder: scale_*.py are found there)

from scale_fixture import load_fixture, table_counts  # noqa: E402
from scale_measure import Figure, Op, Plans, explain, measure, use_database  # noqa: E402
from scale_ops import STAFF_COMPANIES, STALE_LARGE, STALE_SMALL, Bench  # noqa: E402

from tests.support.servers import throwaway_database  # noqa: E402

TARGET = 1.5
# The small database holds one full first page of every list (1,000 leases: 10,000 activity
# rows, 1,000 runs, 1,000 recovery actions), so both databases render the same number of rows
# and a ratio measures what the data's size costs, not the HTML of 100 rows against none.
BASE_LEASES = 1000


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
