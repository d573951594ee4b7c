"""Runtime leases: one exclusive, renewable lane per execution workspace (docs/leases.md).

An agent claims the lane before a runtime action (start/stop/restart/repair). The same owner
renews; anyone else gets `workspace_runtime_lease_conflict` until the holder turns stale
(lease expired, owner issue missing/hidden/terminal, owner run missing/terminal), when the
lane is reclaimed in place. An agent whose own owner is stale by that same verdict is refused
(`workspace_runtime_lease_owner_ineligible`): it neither claims nor writes under the lease.
Board actors bypass the lease. Release deletes the row.

Every create and reclaim hands out a new `generation` from the workspace's
`runtime_lease_generation` counter; it never repeats for a workspace (the counter outlives
the lease row), so it fences writes: `workspace_operation_create_fenced` accepts an operation
only from the owner key that holds the lease at the generation it names, while that owner is
still eligible.

Cross-process exclusivity comes from PostgreSQL alone: the unique lease row per workspace,
row locks in a fixed order (see `leases.locks`), and database time (`now()`) for every TTL.
The renew hot path is one gated UPDATE running as its own implicit transaction; only a miss
takes the slow path (one short durable transaction under the workspace row lock). The claim
round trips are raw SQL because this is the hottest write in the system (see bench/leases.py).

What lives where:

- `types`: constants (`LEASED_ACTIONS`, `TTL_MIN_SECONDS`, `TTL_MAX_SECONDS`) and the value
  types (`RuntimeLeaseOwner`, `RuntimeLeaseClaim`, `ReclaimedFrom`, `RuntimeLeaseRelease`,
  `WorkspaceOperationRecord`, `RuntimeLeaseSweepBatch`, `RuntimeLeaseSweepReport`);
- `claim`: `runtime_lease_claim` (renew fast path, create, reclaim, bypass);
- `release`: `runtime_lease_release`, `runtime_lease_force_release`;
- `operations`: `workspace_operation_create_fenced` (generation-fenced writes);
- `sweep`: `runtime_lease_sweep`, `runtime_lease_sweep_batch`;
- `snapshots`: `run_snapshot_register` (the runtime lease's fence around snapshot registration,
  whose core is `paperclip.snapshots.registration`);
- `shared`: what several of them use (precondition check, audit helper, lease fetch);
- reads re-exported from `leases.selectors`: `runtime_lease_get`,
  `runtime_lease_evaluate_stale`, `RuntimeLease`, `RuntimeLeaseView`, `STALE_REASONS`.

Code inside this package imports from the defining module; this facade is for the rest of
the project (API, admin, commands, bench, tests).
"""

from __future__ import annotations

from leases.selectors import (
    STALE_REASONS,
    RuntimeLease,
    RuntimeLeaseView,
    runtime_lease_evaluate_stale,
    runtime_lease_get,
)
from leases.services.claim import runtime_lease_claim
from leases.services.operations import workspace_operation_create_fenced
from leases.services.release import runtime_lease_force_release, runtime_lease_release
from leases.services.snapshots import run_snapshot_register
from leases.services.sweep import runtime_lease_sweep, runtime_lease_sweep_batch
from leases.services.types import (
    LEASED_ACTIONS,
    TTL_MAX_SECONDS,
    TTL_MIN_SECONDS,
    ReclaimedFrom,
    RuntimeLeaseClaim,
    RuntimeLeaseOwner,
    RuntimeLeaseRelease,
    RuntimeLeaseSweepBatch,
    RuntimeLeaseSweepReport,
    WorkspaceOperationRecord,
)

__all__ = [
    "LEASED_ACTIONS",
    "STALE_REASONS",
    "TTL_MAX_SECONDS",
    "TTL_MIN_SECONDS",
    "ReclaimedFrom",
    "RuntimeLease",
    "RuntimeLeaseClaim",
    "RuntimeLeaseOwner",
    "RuntimeLeaseRelease",
    "RuntimeLeaseSweepBatch",
    "RuntimeLeaseSweepReport",
    "RuntimeLeaseView",
    "WorkspaceOperationRecord",
    "run_snapshot_register",
    "runtime_lease_claim",
    "runtime_lease_evaluate_stale",
    "runtime_lease_force_release",
    "runtime_lease_get",
    "runtime_lease_release",
    "runtime_lease_sweep",
    "runtime_lease_sweep_batch",
    "workspace_operation_create_fenced",
]
