"""The rule every stop-only intent and receipt obeys: it names this exact lease (company, run,
lease, provider, allocation)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from leases.models import EnvironmentLease


def lease_metadata(lease: EnvironmentLease) -> dict[str, Any]:
    return lease.metadata if isinstance(lease.metadata, dict) else {}


def nonempty_str(value: object) -> bool:
    return isinstance(value, str) and value != ""


def binding_problem(intent: Mapping[str, Any], lease: EnvironmentLease) -> str | None:
    """Which binding check fails first (company, run, lease, provider, allocation), or None."""
    if lease.heartbeat_run_id is None:
        return "the lease has no run"
    if not nonempty_str(lease.provider):
        return "the lease has no provider"
    if not nonempty_str(lease.provider_lease_id):
        return "the lease has no provider allocation id"
    for key, expected in (
        ("companyId", str(lease.company_id)),
        ("runId", str(lease.heartbeat_run_id)),
        ("leaseId", str(lease.id)),
        ("provider", lease.provider),
        ("providerLeaseId", lease.provider_lease_id),
    ):
        if intent.get(key) != expected:
            return f"{key} does not equal the lease's ({intent.get(key)!r} != {expected!r})"
    return None
