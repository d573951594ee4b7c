"""A provider's stop/destroy reply bound to the exact lease it answers, and the check that a
retired lease's stored receipt still binds (docs/environment.md#provider-reply-binding)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from leases.environment.export_resume.binding import lease_metadata, nonempty_str
from leases.environment.export_resume.keys import REMOTE_TERMINATION_KEY, REMOTE_TERMINATION_SCHEMA
from leases.models import EnvironmentLease


def remote_termination_receipt(
    lease: EnvironmentLease, value: object, *, confirmed_at: datetime
) -> dict[str, Any] | None:
    """Bind a provider's stop/destroy reply to this exact lease
    (docs/environment.md#provider-reply-binding).

    None unless the lease has a run, a non-local provider and an allocation, the reply names
    that allocation, and its state is `stopped` or `destroyed`.
    """
    if (
        not isinstance(value, Mapping)
        or lease.heartbeat_run_id is None
        or not nonempty_str(lease.provider)
        or lease.provider == "local"
        or not nonempty_str(lease.provider_lease_id)
        or value.get("providerLeaseId") != lease.provider_lease_id
        or value.get("state") not in ("stopped", "destroyed")
    ):
        return None
    return {
        "schema": REMOTE_TERMINATION_SCHEMA,
        "companyId": str(lease.company_id),
        "runId": str(lease.heartbeat_run_id),
        "leaseId": str(lease.id),
        "provider": lease.provider,
        "providerLeaseId": lease.provider_lease_id,
        "state": value["state"],
        "confirmedAt": confirmed_at.isoformat(),
    }


def remote_termination_has(lease: EnvironmentLease) -> bool:
    """True only for a retired, successfully cleaned lease whose stored termination receipt
    still binds to it."""
    receipt = lease_metadata(lease).get(REMOTE_TERMINATION_KEY)
    if (
        lease.released_at is None
        or lease.cleanup_status != EnvironmentLease.CleanupStatus.SUCCESS
        or lease.status not in EnvironmentLease.RETIRED_STATUSES
        or not isinstance(receipt, dict)
        or receipt.get("schema") != REMOTE_TERMINATION_SCHEMA
        or not isinstance(receipt.get("confirmedAt"), str)
    ):
        return False
    rebound = remote_termination_receipt(
        lease, receipt, confirmed_at=datetime.fromisoformat("1970-01-01T00:00:00+00:00")
    )
    return rebound is not None and all(
        rebound[k] == receipt.get(k) for k in ("companyId", "runId", "leaseId", "provider")
    )
