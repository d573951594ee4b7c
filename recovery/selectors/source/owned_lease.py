"""`recovery_source_owned_lease`: the source lease the preservation owner holding the
finalization ownership may reopen."""

from __future__ import annotations

from typing import Protocol
from uuid import UUID

from leases.environment.export_resume.markers import stop_only_cleanup_read
from leases.models import EnvironmentLease
from recovery.errors import binding_failure
from recovery.selectors.source.inspection import recovery_source_inspect
from recovery.selectors.source.lease_checks import RecoverySource
from recovery.selectors.source.remote_references import as_dict


class FinalizationOwnershipHandle(Protocol):
    """What `recovery.services.with_finalization_ownership` hands its action."""

    @property
    def token(self) -> str | UUID: ...

    def assert_held(self) -> None: ...


def recovery_source_owned_lease(
    *,
    company_id: UUID,
    issue_id: UUID,
    run_id: UUID,
    action_id: UUID,
    lease_id: UUID,
    environment_id: UUID,
    ownership: FinalizationOwnershipHandle,
) -> RecoverySource:
    """The source `lease_id`, if the preservation owner holding `ownership` may reopen it.

    Only its exact stop-only allocation: ownership held (before and after), the lease among
    the inspected sources, in environment `environment_id`, `pending_cleanup` with a live
    claim (`pendingCleanupInFlight`) whose attempt id is the ownership token, and a valid
    stop-only intent. This does not lift the source's execution or destruction fence.
    Raises what `ownership.assert_held()` raises, everything `recovery_source_inspect`
    raises, and `source_binding_invalid` with `recovery_lease_not_selected`,
    `recovery_environment_mismatch`, `recovery_lease_not_claimed`, `recovery_owner_mismatch`
    or `recovery_stop_intent_missing`.
    """
    ownership.assert_held()
    inspected = recovery_source_inspect(
        company_id=company_id, issue_id=issue_id, run_id=run_id, action_id=action_id
    )
    source = next((s for s in inspected.sources if s.lease.pk == lease_id), None)
    if source is None:
        raise binding_failure("recovery_lease_not_selected")
    if source.environment.pk != environment_id:
        raise binding_failure("recovery_environment_mismatch")
    metadata = as_dict(source.lease.metadata)
    if (
        source.lease.status != EnvironmentLease.Status.PENDING_CLEANUP
        or metadata.get("pendingCleanupInFlight") is not True
    ):
        raise binding_failure("recovery_lease_not_claimed")
    if metadata.get("pendingCleanupAttemptId") != str(ownership.token):
        raise binding_failure("recovery_owner_mismatch")
    if stop_only_cleanup_read(source.lease) is None:
        raise binding_failure("recovery_stop_intent_missing")
    ownership.assert_held()
    return source
