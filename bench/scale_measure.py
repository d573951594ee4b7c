"""bench/scale.py's measuring: the median of each operation on each database (switching
between them every round) and the EXPLAIN pass that flags big-table sequential scans."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from scale_fixture import BIG_TABLES, SEQ_SCAN_ROWS


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
