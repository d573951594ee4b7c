"""Gauges of what is stuck, computed from the database at scrape time by the selectors of the
console's dashboard (recovery/console/attention.py), so that the two never disagree: every
host's /metrics answers the same numbers (aggregate them with max(), not sum()), and they can
never drift from the rows they describe."""

from __future__ import annotations

from collections.abc import Iterator

from django.db.models import Count
from procrastinate.contrib.django.models import ProcrastinateJob
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from recovery.console.attention import attention_summary


class StuckWorkCollector(Collector):
    def collect(self) -> Iterator[GaugeMetricFamily]:
        summary = attention_summary(company_ids=None, include_jobs=True)
        stuck = GaugeMetricFamily(
            "paperclip_stuck_work",
            "Stuck work by kind (the dashboard's tiles; `reason`: a stale lease's reason).",
            labels=["kind", "reason"],
        )
        oldest = GaugeMetricFamily(
            "paperclip_stuck_work_oldest_age_seconds",
            "Seconds the oldest stuck item of each kind has waited (absent: none waiting).",
            labels=["kind", "reason"],
        )
        for tile in summary.tiles:
            if tile.kind == "worker_heartbeat_stale":
                continue  # paperclip_worker_heartbeat_age_seconds says it better
            labels = [tile.kind, tile.detail or ""]
            stuck.add_metric(labels, tile.count)
            if tile.oldest_at is not None:
                age = (summary.as_of - tile.oldest_at).total_seconds()
                oldest.add_metric(labels, max(0.0, age))
        yield stuck
        yield oldest
        orphaned = GaugeMetricFamily(
            "paperclip_orphaned_runs",
            "Running runs every lease of which lapsed (their agent is gone), not yet interrupted.",
        )
        orphaned.add_metric(
            [], sum(tile.count for tile in summary.tiles if tile.kind == "run_orphaned")
        )
        yield orphaned
        heartbeat = GaugeMetricFamily(
            "paperclip_worker_heartbeat_age_seconds",
            "Seconds since the freshest worker heartbeat (absent: no worker ever registered).",
        )
        if summary.worker_last_heartbeat_at is not None:
            age = (summary.as_of - summary.worker_last_heartbeat_at).total_seconds()
            heartbeat.add_metric([], max(0.0, age))
        yield heartbeat
        jobs = GaugeMetricFamily(
            "paperclip_jobs", "Worker jobs by status (todo, doing, failed, ...).", labels=["status"]
        )
        for row in ProcrastinateJob.objects.values("status").annotate(n=Count("id")):
            jobs.add_metric([row["status"]], row["n"])
        yield jobs
