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
from typing import Any

from prometheus_client import Counter, Histogram

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

type _Effect = Callable[[Mapping[str, Any]], None]

# Audit action -> what its commit moves. One table, so that a new action is one line here.
_AUDIT_EFFECTS: dict[str, tuple[_Effect, ...]] = {
    "runtime_lease.created": (lambda d: RUNTIME_LEASE_CLAIMS.labels("created").inc(),),
    "runtime_lease.bypassed": (lambda d: RUNTIME_LEASE_CLAIMS.labels("bypassed").inc(),),
    "runtime_lease.reclaimed": (
        lambda d: RUNTIME_LEASE_CLAIMS.labels("reclaimed").inc(),
        lambda d: RUNTIME_LEASE_RECLAIMS.labels(str(d.get("reason") or "unknown")).inc(),
    ),
    "runtime_lease.released": (lambda d: RUNTIME_LEASE_RELEASES.labels("released").inc(),),
    "runtime_lease.force_released": (
        lambda d: RUNTIME_LEASE_RELEASES.labels("force_released").inc(),
    ),
    "runtime_lease.swept": (lambda d: RUNTIME_LEASE_RELEASES.labels("swept").inc(),),
    "controller_lease.acquired": (lambda d: CONTROLLER_LEASES.labels("acquired").inc(),),
    "controller_lease.taken_over": (lambda d: CONTROLLER_LEASES.labels("taken_over").inc(),),
    "controller_lease.expired": (lambda d: CONTROLLER_LEASES.labels("expired").inc(),),
    "controller_lease.expired_on_failure": (lambda d: CONTROLLER_LEASES.labels("expired").inc(),),
    "run.workspace_finalize_started": (lambda d: FINALIZATIONS.labels("started").inc(),),
    "run.finalization_committed": (lambda d: FINALIZATIONS.labels("committed").inc(),),
    "run.workspace_finalize_retry_exhausted": (lambda d: FINALIZATIONS.labels("failed").inc(),),
    "run.workspace_finalize_abandoned": (lambda d: FINALIZATIONS.labels("abandoned").inc(),),
    "issue.workspace_owner_stop_confirmed": (
        lambda d: OWNER_STOP_CONFIRMATIONS.labels("board").inc(),
    ),
    "issue.workspace_owner_stop_verified": (
        lambda d: OWNER_STOP_CONFIRMATIONS.labels("platform").inc(),
    ),
    "environment_lease.cleanup_claimed": (lambda d: ENVIRONMENT_CLEANUPS.labels("claimed").inc(),),
    "environment_lease.cleanup_settled": (lambda d: ENVIRONMENT_CLEANUPS.labels("settled").inc(),),
    "environment_lease.cleanup_retry_due": (
        lambda d: ENVIRONMENT_CLEANUPS.labels("retry_due").inc(),
    ),
}

# The counters the table above moves (a test checks each row moves exactly its own).
_COUNTED_BY_AUDIT = (
    RUNTIME_LEASE_CLAIMS,
    RUNTIME_LEASE_RECLAIMS,
    RUNTIME_LEASE_RELEASES,
    CONTROLLER_LEASES,
    FINALIZATIONS,
    OWNER_STOP_CONFIRMATIONS,
    ENVIRONMENT_CLEANUPS,
)


def audit_counters_move(action: str, details: Mapping[str, Any]) -> None:
    """Move the counters of one committed audit row."""
    AUDIT_EVENTS.labels(action).inc()
    for effect in _AUDIT_EFFECTS.get(action, ()):
        effect(details)


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
