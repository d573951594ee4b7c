"""Gauges of what is stuck, computed from the database at scrape time: every host's /metrics
answers the same numbers (aggregate them with max(), not sum()), and they can never drift from
the rows they describe."""

from __future__ import annotations

from collections.abc import Iterator

from django.db.models import Count
from procrastinate.contrib.django.models import ProcrastinateJob
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from paperclip.db.clock import db_now
from paperclip.worker.health import freshest_worker_heartbeat


class StuckWorkCollector(Collector):
    def collect(self) -> Iterator[GaugeMetricFamily]:
        jobs = GaugeMetricFamily(
            "paperclip_jobs", "Worker jobs by status (todo, doing, failed, ...).", labels=["status"]
        )
        for row in ProcrastinateJob.objects.values("status").annotate(n=Count("id")):
            jobs.add_metric([row["status"]], row["n"])
        yield jobs
        last = freshest_worker_heartbeat()
        heartbeat = GaugeMetricFamily(
            "paperclip_worker_heartbeat_age_seconds",
            "Seconds since the freshest worker heartbeat (absent: no worker ever registered).",
        )
        if last is not None:
            heartbeat.add_metric([], max(0.0, (db_now() - last).total_seconds()))
        yield heartbeat
