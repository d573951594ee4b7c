"""The hand-off of a reusable allocation: which retired leases legitimately handed it on,
and whether each predecessor's run is over, settled and saved its work to this exact place."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final
from uuid import UUID

from leases.environment.export_resume.sync_reference import (
    NativeWorkspaceSyncReference,
    read_native_workspace_sync_reference,
)
from leases.models import EnvironmentLease
from paperclip.models import HeartbeatRun, NativeRunFinalization
from recovery.errors import SourceFailure
from recovery.selectors.source.execution import adapter_executing, controller_lease_live
from recovery.selectors.source.remote_references import (
    RemoteWorkspaceReference,
    as_dict,
    read_remote_workspace_reference,
)

REUSABLE_POLICIES: Final = ("reuse_by_environment", "reuse_by_execution_workspace")
SETTLED_COORDINATOR_PHASES: Final = ("committed", "terminal_failure", "applied")


def ambiguous() -> SourceFailure:
    return SourceFailure("allocation_ownership_ambiguous", "service_required")


def retired_reusable_lease_predecessors(
    lease: EnvironmentLease, history: Sequence[EnvironmentLease]
) -> list[EnvironmentLease] | None:
    """The retired leases that legitimately handed this reusable allocation to `lease`.

    `history` is every *other* lease of the same (provider, provider_lease_id). No history:
    `[]`. Otherwise the history must read as one clean hand-off chain ending in `lease`, or
    the answer is None (ambiguous ownership, which callers must never guess about):
    - `lease` itself has a reusable policy (only reuse hands an allocation on);
    - every predecessor has the same company, environment, provider and allocation as
      `lease`, a reusable policy, and a run (the run is what proves its work was saved);
    - every predecessor is retired: status released, expired or failed, with `released_at`
      set and not before its own `acquired_at` (nothing else is live on the allocation);
    - every predecessor was acquired strictly before `lease`, and no two leases (lease
      included) share an acquisition timestamp (no order ambiguity);
    - in acquisition order each lease was released no later than the next one was acquired
      (no overlap), the last one no later than `lease` was acquired;
    - all predecessor runs differ from each other and from `lease`'s run.
    Returns the predecessors in acquisition order.
    """
    if not history:
        return []
    if lease.lease_policy not in REUSABLE_POLICIES:
        return None
    chain = sorted(history, key=lambda item: item.acquired_at)
    stamps = [item.acquired_at for item in chain] + [lease.acquired_at]
    runs = [item.heartbeat_run_id for item in chain] + [lease.heartbeat_run_id]
    if len(set(stamps)) != len(stamps) or len(set(runs)) != len(runs):
        return None
    for item in chain:
        if (
            item.pk == lease.pk
            or item.company_id != lease.company_id
            or item.environment_id != lease.environment_id
            or item.provider != lease.provider
            or item.provider_lease_id != lease.provider_lease_id
            or item.lease_policy not in REUSABLE_POLICIES
            or item.heartbeat_run_id is None
            or item.status not in EnvironmentLease.RETIRED_STATUSES
            or item.released_at is None
            or item.released_at < item.acquired_at
            or item.acquired_at >= lease.acquired_at
        ):
            return None
    for before, after in zip(chain, [*chain[1:], lease], strict=True):
        if before.released_at is None or before.released_at > after.acquired_at:
            return None
    return chain


def check_predecessors(
    predecessors: list[EnvironmentLease],
    *,
    company_id: UUID,
    issue_id: UUID,
    run: HeartbeatRun,
    descriptor: NativeWorkspaceSyncReference | RemoteWorkspaceReference,
    remote_descriptor: RemoteWorkspaceReference | None,
    provider_lease_id: str,
    remote_cwd: str,
    now: Any,
) -> None:
    """Every predecessor's run must be over, settled and have saved its work to this exact
    allocation, workspace and directory; anything else is ambiguous ownership."""
    run_ids = [item.heartbeat_run_id for item in predecessors if item.heartbeat_run_id]
    priors = {r.pk: r for r in HeartbeatRun.objects.filter(company_id=company_id, pk__in=run_ids)}
    owners = {
        f.run_id: f
        for f in NativeRunFinalization.objects.filter(
            company_id=company_id, run_id__in=run_ids, issue_id=issue_id
        )
    }
    for predecessor in predecessors:
        if predecessor.heartbeat_run_id is None:  # excluded by the hand-off rule
            raise ambiguous()
        prior = priors.get(predecessor.heartbeat_run_id)
        owner = owners.get(predecessor.heartbeat_run_id)
        if (
            prior is None
            or prior.runtime_mode != HeartbeatRun.RuntimeMode.NATIVE
            or prior.agent_id != run.agent_id
            or prior.native_issue_id != issue_id
            or prior.status not in HeartbeatRun.TERMINAL_STATUSES
            or adapter_executing(prior.pk)
            or owner is None
            or controller_lease_live(owner, now)
            or owner.phase not in SETTLED_COORDINATOR_PHASES
        ):
            raise ambiguous()
        profile = as_dict(prior.runner_profile_json)
        prior_reference = read_native_workspace_sync_reference(profile.get("nativeWorkspaceSync"))
        prior_remote = read_remote_workspace_reference(profile.get("remoteWorkspace"))
        prior_descriptor = prior_reference or prior_remote
        if prior_reference is not None:
            saved = prior_reference.state == "finalized" and bool(prior_reference.final_host_sha256)
        else:
            saved = (
                prior_remote is not None
                and prior_remote.state == "saved"
                and bool(prior_remote.snapshot_id)
                and remote_descriptor is not None
                and prior_remote.epoch < remote_descriptor.epoch
            )
        if (
            prior_descriptor is None
            or not saved
            or prior_descriptor.lease_id != str(predecessor.pk)
            or prior_descriptor.provider_lease_id != provider_lease_id
            or prior_descriptor.workspace_id != descriptor.workspace_id
            or prior_descriptor.remote_cwd != remote_cwd
        ):
            raise ambiguous()
