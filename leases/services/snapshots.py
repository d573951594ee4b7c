"""Snapshot registration fenced by the runtime lease: a run's agent names the tree of its
workdir under the lease it holds (docs/snapshots.md#registering-a-snapshot).

The checks of the tree and the snapshot's rows are the snapshots package's
(`paperclip.snapshots.registration`); this service adds the fence: its transaction checks the
run's workspace, issue and run, share-locks the lease row and checks the fence as for any
fenced write, then records the snapshot and audits it. Nothing is written on any error.
"""

from __future__ import annotations

from functools import partial
from uuid import UUID

from django.db import IntegrityError, transaction

from leases import locks
from leases.errors import RuntimeLeaseContended
from leases.services.operations import require_fence
from leases.services.shared import audit, preconditions
from leases.services.types import BUSY_MESSAGE, RuntimeLeaseOwner
from paperclip.db.locking import busy_on_lock_timeout
from paperclip.errors import InvalidRequest
from paperclip.models import HeartbeatRun
from paperclip.snapshots.registration import (
    RegistrationPlan,
    SnapshotRegistration,
    SnapshotTarget,
    registration_head_hold_in_tx,
    snapshot_input_check,
    snapshot_record_in_tx,
    snapshot_register,
)


def run_snapshot_register(
    *,
    company_id: UUID,
    run_id: UUID,
    agent_id: UUID,
    tree: str,
    base: str | None,
    generation: int,
    fence: int | None = None,
) -> SnapshotRegistration:
    """Register `tree` (the run's workdir, started from `base`, the head its checkout fetched)
    for the run's agent, fenced by the runtime lease of the run's workspace.

    The lease must be held at `generation` by the run (`run:<id>`) or by the run's issue
    (`issue:<id>`). Locks: when the plan trusts the head, the company's roots advisory lock
    (shared); the lease row FOR SHARE (as every fenced write), then the rows of the blobs to
    pin. Raises InvalidRequest, SnapshotTreeInvalid (400), SnapshotBlobsMissing
    (409, at most 1,000 names), RuntimeLeaseSuperseded / RuntimeLeaseOwnerIneligible (409),
    the lease's 404/403s, ResourceBusy. Audited once; a repeat of a registered tree writes
    nothing.
    """
    snapshot_input_check(company_id=company_id, tree=tree, base=base)
    run = (
        HeartbeatRun.objects.filter(pk=run_id, company_id=company_id)
        .values("agent_id", "execution_workspace_id", "issue_id", "native_issue_id")
        .first()
    )
    if run is None or run["agent_id"] != agent_id:
        raise InvalidRequest("The run is not this agent's.")  # the API 404s before this
    workspace_id: UUID | None = run["execution_workspace_id"]
    if workspace_id is None:
        raise InvalidRequest(
            "The run has no execution workspace, so it has no lease to fence the snapshot.",
            fields={"run_id": ["The run names no execution workspace."]},
        )
    target = SnapshotTarget(
        company_id=company_id,
        run_id=run_id,
        workspace_id=workspace_id,
        tree=tree,
        base=base,
        generation=generation,
    )
    attempt = partial(
        _register_in_tx,
        target=target,
        owner=RuntimeLeaseOwner.for_agent(agent_id, run_id=run_id),
        issue_id=run["native_issue_id"] or run["issue_id"],
        fence=fence,
    )
    return snapshot_register(target, attempt=attempt)


def _register_in_tx(
    plan: RegistrationPlan,
    *,
    target: SnapshotTarget,
    owner: RuntimeLeaseOwner,
    issue_id: UUID | None,
    fence: int | None,
) -> SnapshotRegistration:
    company_id, workspace_id = target.company_id, target.workspace_id
    with busy_on_lock_timeout(BUSY_MESSAGE):
        try:
            with transaction.atomic(durable=True):
                preconditions(
                    company_id=company_id, execution_workspace_id=workspace_id, owner=owner
                )
                # advisory locks first (docs/locking.md)
                registration_head_hold_in_tx(plan, target=target)
                _require_fence_in_tx(target=target, owner=owner, issue_id=issue_id, fence=fence)
                registered = snapshot_record_in_tx(plan, target=target)
                if registered.created:
                    _audit_in_tx(plan, target=target, owner=owner)
        except IntegrityError as exc:  # the same tree registered concurrently
            raise RuntimeLeaseContended(
                execution_workspace_id=str(workspace_id), requested_action="snapshot"
            ) from exc
    return registered


def _require_fence_in_tx(
    *, target: SnapshotTarget, owner: RuntimeLeaseOwner, issue_id: UUID | None, fence: int | None
) -> None:
    # The owner is judged as the lease's key names it: the run (a lease claimed for the run,
    # refused once the run has ended, as its fenced operations are), or the run's issue (a
    # runner that claimed for the issue). Judging a run-keyed lease by its open issue let a
    # run that had ended register snapshots.
    locked = locks.runtime_lease_for_share(
        execution_workspace_id=target.workspace_id,
        company_id=target.company_id,
        owner_issue_id=None,
        owner_run_id=target.run_id,
    )
    current, ineligible = (None, None) if locked is None else locked
    key = owner.owner_key
    if current is not None and issue_id and current.owner_key == f"issue:{issue_id}":
        key = current.owner_key  # a runner that claimed for the run's issue
        judged = locks.runtime_lease_for_share(
            execution_workspace_id=target.workspace_id,
            company_id=target.company_id,
            owner_issue_id=issue_id,
            owner_run_id=None,
        )
        current, ineligible = (None, None) if judged is None else judged
    require_fence(
        execution_workspace_id=target.workspace_id,
        owner_key=key,
        generation=target.generation,
        current=current,
        ineligible=ineligible,
        fence=fence,
    )


def _audit_in_tx(
    plan: RegistrationPlan, *, target: SnapshotTarget, owner: RuntimeLeaseOwner
) -> None:
    audit(
        owner_actor=(owner.actor_type, owner.actor_id),
        company_id=target.company_id,
        execution_workspace_id=target.workspace_id,
        action="run.snapshot_registered",
        run_id=target.run_id,
        details={
            "tree": target.tree,
            "base": target.base,
            "files": plan.files,
            "bytes": plan.bytes,
            "generation": target.generation,
        },
    )
