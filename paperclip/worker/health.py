"""Worker heartbeats and the readiness report (docs/worker.md#readiness)."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Literal

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connections
from django.db.migrations.executor import MigrationExecutor
from django.db.models import Max
from procrastinate.contrib.django.models import ProcrastinateWorker

from paperclip.db.clock import db_now

Part = Literal["ok", "stale", "down", "pending", "unknown"]


def freshest_worker_heartbeat() -> datetime | None:
    """The most recent heartbeat of any worker (Procrastinate's `procrastinate_workers`)."""
    value: datetime | None = ProcrastinateWorker.objects.aggregate(last=Max("last_heartbeat"))[
        "last"
    ]
    return value


def worker_fresh(*, within_seconds: float | None = None) -> bool:
    """Some worker's heartbeat is fresher than `within_seconds` (default
    PAPERCLIP_WORKER_READY_SECONDS), on the database clock."""
    limit = settings.PAPERCLIP_WORKER_READY_SECONDS if within_seconds is None else within_seconds
    last = freshest_worker_heartbeat()
    return last is not None and last > db_now() - timedelta(seconds=limit)


def readiness(using: str = DEFAULT_DB_ALIAS) -> dict[str, Part]:
    """`{"database", "migrations", "worker"}`, each `ok` or what is wrong: the database `down`,
    migrations `pending`, the worker `stale` (no heartbeat fresher than the setting); parts that
    need the database are `unknown` while it is down."""
    try:
        with connections[using].cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    except Exception:
        return {"database": "down", "migrations": "unknown", "worker": "unknown"}
    executor = MigrationExecutor(connections[using])
    plan = executor.migration_plan(executor.loader.graph.leaf_nodes())
    return {
        "database": "ok",
        "migrations": "pending" if plan else "ok",
        "worker": "ok" if worker_fresh() else "stale",
    }
