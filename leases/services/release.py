"""Release a workspace's runtime lease: its owner's release, or an operator's force release
(docs/leases.md). Release deletes the row; the workspace's generation counter stays, so the
next claim still gets a new generation.
"""

from __future__ import annotations

from typing import Final, Literal
from uuid import UUID

from django.db import transaction

from leases.errors import RuntimeLeaseSuperseded
from leases.selectors import LEASE_COLUMNS, LEASE_TABLE, runtime_lease_get
from leases.services.shared import audit, fetch_lease, lease_details, preconditions
from leases.services.types import BUSY_MESSAGE, RuntimeLeaseOwner, RuntimeLeaseRelease
from paperclip.db.locking import busy_on_lock_timeout
from paperclip.errors import InvalidRequest

_DELETE_OWNED_SQL: Final = (
    f"DELETE FROM {LEASE_TABLE} WHERE execution_workspace_id = %s"  # noqa: S608
    " AND (company_id, owner_key) IS NOT DISTINCT FROM (%s::uuid, %s::text)"
    f" RETURNING {LEASE_COLUMNS}"
)


_DELETE_ANY_SQL: Final = (
    f"DELETE FROM {LEASE_TABLE} WHERE execution_workspace_id = %s AND company_id = %s"  # noqa: S608
    " AND (%s::bigint IS NULL OR generation = %s::bigint)"
    f" RETURNING {LEASE_COLUMNS}"
)


def runtime_lease_release(
    *, company_id: UUID, execution_workspace_id: UUID, owner: RuntimeLeaseOwner
) -> RuntimeLeaseRelease:
    """Delete the workspace's lease only if `owner`'s key holds it.

    Locks: the lease row (by the DELETE). An owner without any id releases nothing. Raises
    the same 404/403 errors as a claim for foreign ids, ResourceBusy. Audits a release.
    """
    owner_key = owner.owner_key
    with busy_on_lock_timeout(BUSY_MESSAGE), transaction.atomic(durable=True):
        preconditions(
            company_id=company_id, execution_workspace_id=execution_workspace_id, owner=owner
        )
        if owner_key is None:
            return RuntimeLeaseRelease(released=False, owner_key=None)
        deleted = fetch_lease(_DELETE_OWNED_SQL, [execution_workspace_id, company_id, owner_key])
        if deleted is None:
            return RuntimeLeaseRelease(released=False, owner_key=None)
        audit(
            owner_actor=(owner.actor_type, owner.actor_id),
            company_id=company_id,
            execution_workspace_id=execution_workspace_id,
            action="runtime_lease.released",
            run_id=owner.run_id,
            details=lease_details(deleted),
        )
    return RuntimeLeaseRelease(released=True, owner_key=deleted.owner_key, lease=deleted)


def runtime_lease_force_release(
    *,
    company_id: UUID,
    execution_workspace_id: UUID,
    actor_type: Literal["user", "system"],
    actor_id: str,
    reason: str,
    expected_generation: int | None = None,
) -> RuntimeLeaseRelease:
    """Operator release: delete whatever lease the workspace has (board/system callers only;
    the API and admin enforce that). `reason` (non-blank) is kept in the audit row.

    With `expected_generation` (the admin pins what the operator saw), a lease that was
    reclaimed or re-created since is left alone: RuntimeLeaseSuperseded.
    Locks: the lease row. Raises InvalidRequest, ExecutionWorkspaceNotFound, ResourceBusy.
    """
    reason = (reason or "").strip()
    if not reason:
        raise InvalidRequest(fields={"reason": ["A reason is required to force-release."]})
    owner = RuntimeLeaseOwner(actor_type, actor_id)
    with busy_on_lock_timeout(BUSY_MESSAGE), transaction.atomic(durable=True):
        preconditions(
            company_id=company_id, execution_workspace_id=execution_workspace_id, owner=owner
        )
        deleted = fetch_lease(
            _DELETE_ANY_SQL,
            [execution_workspace_id, company_id, expected_generation, expected_generation],
        )
        if deleted is None:
            if expected_generation is not None:
                current = runtime_lease_get(execution_workspace_id=execution_workspace_id)
                if current.lease is not None:
                    raise RuntimeLeaseSuperseded(
                        execution_workspace_id=str(execution_workspace_id),
                        requested_generation=expected_generation,
                        current_generation=current.lease.generation,
                    )
            return RuntimeLeaseRelease(released=False, owner_key=None)
        audit(
            owner_actor=(actor_type, actor_id),
            company_id=company_id,
            execution_workspace_id=execution_workspace_id,
            action="runtime_lease.force_released",
            # The evicted run's page shows it (its audit rows and timeline).
            run_id=deleted.owner_run_id,
            details={**lease_details(deleted), "reason": reason},
        )
    return RuntimeLeaseRelease(released=True, owner_key=deleted.owner_key, lease=deleted)
