"""Prometheus metrics (docs/operations.md#metrics).

Counters and histograms live in each process and are summed across the processes of a host by
prometheus_client's multiprocess mode: settings point PROMETHEUS_MULTIPROC_DIR at
PAPERCLIP_METRICS_DIR before this module is imported, so the web workers and the job workers of
one host write beside each other and `GET /metrics` on that host reads them all. The gauges of
stuck work are not process state at all: they are read from the database at scrape time by
`StuckWorkCollector`, through the selectors the console's dashboard uses.

Most event counters follow the audit log: `audit_committed` runs after the commit of each audit
row and moves the counters its action maps to, so a counter moves once per committed state
change and never for a rolled-back one. What writes no audit row (renewals, refusals, reads,
durations, jobs) is counted where it happens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter, Histogram
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_COPY_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)

HTTP_REQUESTS = Counter(
    "paperclip_http_requests_total",
    "HTTP requests answered, by route name, method and status code.",
    ["route", "method", "status"],
)
HTTP_DURATION = Histogram(
    "paperclip_http_request_duration_seconds",
    "Time to answer an HTTP request, by route name and method.",
    ["route", "method"],
    buckets=_LATENCY_BUCKETS,
)
API_ERRORS = Counter(
    "paperclip_api_errors_total",
    "Error responses of the API by stable error code and status (conflicts, superseded "
    "writes, refusals).",
    ["code", "status"],
)
AUDIT_EVENTS = Counter(
    "paperclip_audit_events_total",
    "Committed audit rows (state changes) by action.",
    ["action"],
)
RUNTIME_LEASE_CLAIMS = Counter(
    "paperclip_runtime_lease_claims_total",
    "Runtime-lease claims granted, by outcome (created, renewed, reclaimed, bypassed); "
    'refused claims are paperclip_api_errors_total{code="runtime_lease_conflict"}.',
    ["outcome"],
)
RUNTIME_LEASE_RECLAIMS = Counter(
    "paperclip_runtime_lease_reclaims_total",
    "Runtime leases reclaimed from a stale owner, by stale reason.",
    ["reason"],
)
RUNTIME_LEASE_RELEASES = Counter(
    "paperclip_runtime_lease_releases_total",
    "Runtime leases ended, by kind (released by the owner, force_released by the board, "
    "swept by the worker).",
    ["kind"],
)
FENCED_WRITES_REJECTED = Counter(
    "paperclip_fenced_writes_rejected_total",
    "Writes refused because their lease generation or controller lease was superseded, by "
    "error code.",
    ["code"],
)
CONTROLLER_LEASES = Counter(
    "paperclip_controller_lease_operations_total",
    "Controller-lease operations by kind (acquired, renewed, taken_over, expired).",
    ["operation"],
)
CHECKPOINT_OPERATIONS = Counter(
    "paperclip_checkpoint_operations_total",
    "Checkpoint operations by kind (write, read, header, parts).",
    ["operation"],
)
CHECKPOINT_BYTES = Counter(
    "paperclip_checkpoint_bytes_total",
    "Plaintext bytes of checkpoint parts written or read.",
    ["operation"],
)
CHECKPOINT_PARTS = Counter(
    "paperclip_checkpoint_parts_total",
    "Checkpoint parts written, removed or read.",
    ["operation"],
)
CHECKPOINT_DURATION = Histogram(
    "paperclip_checkpoint_duration_seconds",
    "Time of a checkpoint write or read in the service (encryption and database).",
    ["operation"],
    buckets=_LATENCY_BUCKETS,
)
CHECKPOINT_UNREADABLE_PARTS = Counter(
    "paperclip_checkpoint_unreadable_parts_total",
    "Checkpoint parts that could not be decrypted or verified when read.",
)
FINALIZATIONS = Counter(
    "paperclip_finalizations_total",
    "Finalization attempts by outcome (started, committed, failed, abandoned).",
    ["outcome"],
)
FINALIZATIONS_NOT_ACQUIRED = Counter(
    "paperclip_finalizations_not_acquired_total",
    "Finalization attempts that did not become the owner, by reason.",
    ["reason"],
)
COPYBACK_DURATION = Histogram(
    "paperclip_copyback_duration_seconds",
    "Time of a workspace copy-back.",
    buckets=_COPY_BUCKETS,
)
COPYBACK_BYTES = Counter(
    "paperclip_copyback_bytes_total",
    "Bytes copied back into execution workspaces.",
)
OWNER_STOP_CONFIRMATIONS = Counter(
    "paperclip_owner_stop_confirmations_total",
    "Owner stops confirmed by the board (or verified by the platform).",
    ["kind"],
)
ENVIRONMENT_CLEANUPS = Counter(
    "paperclip_environment_cleanups_total",
    "Environment-lease cleanup events (claimed, settled, stale_receipt, retry_due).",
    ["event"],
)
JOBS = Counter(
    "paperclip_jobs_total",
    "Worker jobs finished, by task and outcome (succeeded, failed).",
    ["task", "outcome"],
)
JOB_DURATION = Histogram(
    "paperclip_job_duration_seconds",
    "Time a worker job ran, by task.",
    ["task"],
    buckets=_COPY_BUCKETS,
)


# Where an audit row's counter takes its label: a fixed value, or a key of the row's details.
@dataclass(frozen=True, slots=True)
class _Detail:
    key: str


type _Effect = tuple[Counter, str | _Detail]

# Audit action -> the counters its commit moves, with their label. One table, so that a new
# action is one line here.
_AUDIT_EFFECTS: dict[str, tuple[_Effect, ...]] = {
    "runtime_lease.created": ((RUNTIME_LEASE_CLAIMS, "created"),),
    "runtime_lease.bypassed": ((RUNTIME_LEASE_CLAIMS, "bypassed"),),
    "runtime_lease.reclaimed": (
        (RUNTIME_LEASE_CLAIMS, "reclaimed"),
        (RUNTIME_LEASE_RECLAIMS, _Detail("reason")),
    ),
    "runtime_lease.released": ((RUNTIME_LEASE_RELEASES, "released"),),
    "runtime_lease.force_released": ((RUNTIME_LEASE_RELEASES, "force_released"),),
    "runtime_lease.swept": ((RUNTIME_LEASE_RELEASES, "swept"),),
    "controller_lease.acquired": ((CONTROLLER_LEASES, "acquired"),),
    "controller_lease.taken_over": ((CONTROLLER_LEASES, "taken_over"),),
    "controller_lease.expired": ((CONTROLLER_LEASES, "expired"),),
    "controller_lease.expired_on_failure": ((CONTROLLER_LEASES, "expired"),),
    "run.workspace_finalize_started": ((FINALIZATIONS, "started"),),
    "run.finalization_committed": ((FINALIZATIONS, "committed"),),
    "run.workspace_finalize_retry_exhausted": ((FINALIZATIONS, "failed"),),
    "run.workspace_finalize_abandoned": ((FINALIZATIONS, "abandoned"),),
    "issue.workspace_owner_stop_confirmed": ((OWNER_STOP_CONFIRMATIONS, "board"),),
    "issue.workspace_owner_stop_verified": ((OWNER_STOP_CONFIRMATIONS, "platform"),),
    "environment_lease.cleanup_claimed": ((ENVIRONMENT_CLEANUPS, "claimed"),),
    "environment_lease.cleanup_settled": ((ENVIRONMENT_CLEANUPS, "settled"),),
    "environment_lease.cleanup_retry_due": ((ENVIRONMENT_CLEANUPS, "retry_due"),),
}
# The counters the table moves (a test checks each row moves exactly its own).
_COUNTED_BY_AUDIT = tuple(
    {id(counter): counter for effects in _AUDIT_EFFECTS.values() for counter, _ in effects}.values()
)


def audit_counters_move(action: str, details: Mapping[str, Any]) -> None:
    """Move the counters of one committed audit row."""
    AUDIT_EVENTS.labels(action).inc()
    for counter, label in _AUDIT_EFFECTS.get(action, ()):
        if isinstance(label, _Detail):
            label = str(details.get(label.key) or "unknown")
        counter.labels(label).inc()


def checkpoint_observed(operation: str, *, parts: int, nbytes: int, started: float) -> None:
    """Count one checkpoint write or read that succeeded (`started`: its perf_counter)."""
    CHECKPOINT_OPERATIONS.labels(operation).inc()
    CHECKPOINT_PARTS.labels(operation).inc(parts)
    CHECKPOINT_BYTES.labels(operation).inc(nbytes)
    CHECKPOINT_DURATION.labels(operation).observe(time.perf_counter() - started)


# Error codes that mean "a superseded owner tried to write" and "a stale cleanup receipt".
_FENCED_CODES = frozenset(
    {"workspace_runtime_lease_superseded", "native_runner_checkpoint_owner_lost"}
)


def error_observed(code: str, status: int) -> None:
    """Count one error response of the API by its stable code."""
    API_ERRORS.labels(code, str(status)).inc()
    if code in _FENCED_CODES:
        FENCED_WRITES_REJECTED.labels(code).inc()
    elif code == "cleanup_attempt_stale":
        ENVIRONMENT_CLEANUPS.labels("stale_receipt").inc()


# --- Collectors read at scrape time ---------------------------------------------------------
# Gauges computed from the database when /metrics is read, contributed by the app that owns
# what they count (the console's stuck-work gauges, registered when the app is ready): the
# core serves them without importing the apps above it.
_SCRAPE_COLLECTORS: list[Callable[[], Collector]] = []


def scrape_collector_register(factory: Callable[[], Collector]) -> None:
    """Add a collector built afresh for every scrape (idempotent)."""
    if factory not in _SCRAPE_COLLECTORS:
        _SCRAPE_COLLECTORS.append(factory)


def scrape_collectors() -> list[Collector]:
    return [factory() for factory in _SCRAPE_COLLECTORS]
