"""Workspace operations fenced by the runtime lease's generation (docs/leases.md).

Every create and reclaim of a lease hands out a new `generation` from the workspace's
`runtime_lease_generation` counter; it never repeats for a workspace (the counter outlives
the lease row), so it fences writes: `workspace_operation_create_fenced` accepts an operation
only from the owner key that holds the lease at the generation it names, and only while that
owner is still eligible (the same verdict that refuses its claims).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Final
from uuid import UUID, uuid4

from django.db import IntegrityError, connection, transaction

from leases import locks
from leases.errors import (
    RuntimeLeaseContended,
    RuntimeLeaseOwnerIneligible,
    RuntimeLeaseSuperseded,
)
from leases.selectors import RuntimeLease, StaleReason
from leases.services.shared import audit, preconditions, str_or_none
from leases.services.types import BUSY_MESSAGE, RuntimeLeaseOwner, WorkspaceOperationRecord
from paperclip.db.locking import busy_on_lock_timeout
from paperclip.errors import DomainError, InvalidRequest
from paperclip.models import WorkspaceOperation

_OPERATION_INSERT_SQL: Final = (
    "INSERT INTO workspace_operations (id, company_id, execution_workspace_id, heartbeat_run_id,"
    " actor_agent_id, actor_run_id, issue_id, phase, command, status, exit_code,"
    " lease_generation, started_at, finished_at, created_at, updated_at)"
    " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, now(),"
    " CASE WHEN %s = 'running' THEN NULL ELSE now() END, now(), now())"
    " RETURNING started_at, finished_at"
)


def workspace_operation_create_fenced(
    *,
    company_id: UUID,
    execution_workspace_id: UUID,
    owner: RuntimeLeaseOwner,
    generation: int,
    phase: str,
    status: str,
    command: str | None = None,
    exit_code: int | None = None,
    fence: int | None = None,
) -> WorkspaceOperationRecord:
    """Record a workspace operation only while `owner`'s key holds the lease at `generation`
    and that owner is still eligible (its issue/run not stale, docs/leases.md#owner-eligibility).

    An expired lease nobody has reclaimed still counts: expiry only lets others take over.
    Locks: the lease row FOR SHARE while inserting, so a reclaim waits for this write and a
    write after the reclaim sees the new generation; the owner is judged in that same
    statement. A refused write rolls back; its rejection is then audited in a separate small
    transaction (so the audit survives). Raises RuntimeLeaseSuperseded (409,
    `current_generation` null when no lease), RuntimeLeaseOwnerIneligible (409, the holder's
    own issue/run is stale), the claim's 404/403 errors, InvalidRequest, ResourceBusy.
    """
    if status not in WorkspaceOperation.Status.values:
        raise InvalidRequest(
            fields={"status": [f"Must be one of: {', '.join(WorkspaceOperation.Status.values)}."]}
        )
    owner_key = owner.owner_key
    with busy_on_lock_timeout(BUSY_MESSAGE):
        try:
            with transaction.atomic(durable=True):
                preconditions(
                    company_id=company_id,
                    execution_workspace_id=execution_workspace_id,
                    owner=owner,
                )
                locked = locks.runtime_lease_for_share(
                    execution_workspace_id=execution_workspace_id,
                    company_id=company_id,
                    owner_issue_id=owner.issue_id,
                    owner_run_id=owner.run_id,
                )
                current, ineligible = (None, None) if locked is None else locked
                require_fence(
                    execution_workspace_id=execution_workspace_id,
                    owner_key=owner_key,
                    generation=generation,
                    current=current,
                    ineligible=ineligible,
                    fence=fence,
                )
                operation_id, started_at, finished_at = _insert_operation_in_tx(
                    company_id=company_id,
                    execution_workspace_id=execution_workspace_id,
                    owner=owner,
                    generation=generation,
                    phase=phase,
                    status=status,
                    command=command,
                    exit_code=exit_code,
                )
        except (RuntimeLeaseSuperseded, RuntimeLeaseOwnerIneligible) as exc:
            _record_rejected_write(
                company_id=company_id,
                execution_workspace_id=execution_workspace_id,
                owner=owner,
                phase=phase,
                action=_REJECTED_WRITE_ACTIONS[type(exc)],
                details=exc.details,
            )
            raise
        except IntegrityError as exc:
            raise RuntimeLeaseContended(
                execution_workspace_id=str(execution_workspace_id), requested_action=phase
            ) from exc
    return WorkspaceOperationRecord(
        id=operation_id,
        company_id=company_id,
        execution_workspace_id=execution_workspace_id,
        heartbeat_run_id=owner.run_id,
        issue_id=owner.issue_id,
        actor_agent_id=owner.agent_id,
        phase=phase,
        command=command,
        status=status,
        exit_code=exit_code,
        lease_generation=generation,
        started_at=started_at,
        finished_at=finished_at,
    )


def require_fence(
    *,
    execution_workspace_id: UUID,
    owner_key: str | None,
    generation: int,
    current: RuntimeLease | None,
    ineligible: StaleReason | None,
    fence: int | None = None,
) -> None:
    """The fence of a write (a plain function of the locked lease): the writer's key must hold
    the lease at exactly its generation, and at exactly its fence when it names one
    (RuntimeLeaseSuperseded otherwise, naming the current holder, if any), and the holder's own
    issue or run must not be stale (`ineligible`, the stale reason:
    RuntimeLeaseOwnerIneligible)."""
    if (
        owner_key is None
        or current is None
        or current.owner_key != owner_key
        or current.generation != generation
        or (fence is not None and current.fence != fence)
    ):
        fences: dict[str, Any] = {}
        if fence is not None:  # named only by writers that pass a fence: older bodies unchanged
            fences = {
                "requested_fence": fence,
                "current_fence": None if current is None else current.fence,
            }
        raise RuntimeLeaseSuperseded(
            execution_workspace_id=str(execution_workspace_id),
            requested_owner_key=owner_key,
            requested_generation=generation,
            current_generation=None if current is None else current.generation,
            owner_key=None if current is None else current.owner_key,
            **fences,
        )
    if ineligible is not None:
        # Holds the lease, but its own issue/run says it may no longer act.
        raise RuntimeLeaseOwnerIneligible(
            execution_workspace_id=str(execution_workspace_id),
            owner_key=owner_key,
            reason=ineligible,
        )


def _insert_operation_in_tx(
    *,
    company_id: UUID,
    execution_workspace_id: UUID,
    owner: RuntimeLeaseOwner,
    generation: int,
    phase: str,
    status: str,
    command: str | None,
    exit_code: int | None,
) -> tuple[UUID, datetime, datetime | None]:
    """Insert the operation (the lease row held FOR SHARE by the caller) and audit it; its id,
    start and finish times."""
    operation_id = uuid4()
    with connection.cursor() as cursor:
        cursor.execute(
            _OPERATION_INSERT_SQL,
            [
                operation_id,
                company_id,
                execution_workspace_id,
                owner.run_id,
                owner.agent_id,
                owner.run_id,
                owner.issue_id,
                phase,
                command,
                status,
                exit_code,
                generation,
                status,
            ],
        )
        inserted = cursor.fetchone()
    assert inserted is not None  # noqa: S101 - INSERT ... RETURNING of one row
    started_at, finished_at = inserted
    audit(
        owner_actor=(owner.actor_type, owner.actor_id),
        company_id=company_id,
        execution_workspace_id=execution_workspace_id,
        action="workspace_operation.recorded",
        run_id=owner.run_id,
        details={
            "operation_id": str(operation_id),
            "phase": phase,
            "status": status,
            "lease_generation": generation,
            "owner_key": owner.owner_key,
        },
    )
    return operation_id, started_at, finished_at


_REJECTED_WRITE_ACTIONS: Final[dict[type[DomainError], str]] = {
    RuntimeLeaseSuperseded: "runtime_lease.superseded_write_rejected",
    RuntimeLeaseOwnerIneligible: "runtime_lease.ineligible_write_rejected",
}


def _record_rejected_write(
    *,
    company_id: UUID,
    execution_workspace_id: UUID,
    owner: RuntimeLeaseOwner,
    phase: str,
    action: str,
    details: dict[str, Any],
) -> None:
    # The refused request's own transaction rolled back (a failed request changes nothing);
    # the evidence that a stale owner tried to act is still worth one audit row of its own.
    with transaction.atomic(durable=True):
        audit(
            owner_actor=(owner.actor_type, owner.actor_id),
            company_id=company_id,
            execution_workspace_id=execution_workspace_id,
            action=action,
            run_id=None,  # the run FK may be the reason the write failed; keep it in details
            details={**details, "phase": phase, "run_id": str_or_none(owner.run_id)},
        )
