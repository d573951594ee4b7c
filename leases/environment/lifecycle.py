"""The environment lease lifecycle (docs/environment.md#lifecycle-over-http): environments
created by the board; provider agents acquire a lease for a run, heartbeat it and release it
with an outcome. The release applies the lease policy and the export-resume marker rules, and
hands the allocation to the cleanup protocol of `leases.environment.services` when it must go.

Release, per policy and outcome (no export-resume marker):
- `ephemeral` (either outcome), `retain_on_failure` + `succeeded` → `pending_cleanup` with a
  pending cleanup attempt (providers claim it, then report a receipt);
- `retain_on_failure` + `failed` → `retained` (kept for inspection, never cleaned up);
- `reuse_by_environment`, `reuse_by_execution_workspace` → `released` (kept for reuse).

Marker rules, before the policy:
- a lease holding an export-resume marker first tries `export_resume_release_completed`
  (verified copy-back and commitment remove the marker; then the policy applies); a marker that
  stays (valid or not) keeps a `retain_on_failure` + `failed` lease `retained` and makes every
  other release `pending_cleanup`, marker kept: its cleanup is stop-only, and an invalid
  marker is never claimable (an operator must look);
- a `failed` release of the run's prepared export lease with an accepted result is tagged by
  `export_resume_preserve` (stop-only, pending cleanup) instead of following the policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal
from uuid import UUID

from django.db import IntegrityError, transaction
from django.db.models import QuerySet
from django.db.models.functions import Now

from leases.environment.errors import (
    EnvironmentArchived,
    EnvironmentLeaseNotActive,
    EnvironmentLeaseNotFound,
    EnvironmentLeaseSingleFlight,
    EnvironmentNotFound,
)
from leases.environment.export_resume.keys import EXPORT_STOP_PENDING
from leases.environment.export_resume.markers import export_resume_has
from leases.environment.export_resume.preserve import export_resume_preserve
from leases.environment.export_resume.release import export_resume_release_completed
from leases.environment.locks import environment_leases_for_update, environment_slot_key
from leases.models import EnvironmentLease
from paperclip.access import Actor, scoped_company
from paperclip.activity import activity_record
from paperclip.db.advisory import advisory_xact_lock
from paperclip.db.locking import bounded_lock_wait, require_transaction
from paperclip.errors import NotFoundError, PermissionDenied
from paperclip.models import (
    Environment,
    ExecutionWorkspace,
    HeartbeatRun,
    NativeRunResult,
)

Outcome = Literal["succeeded", "failed"]
RELEASE_OUTCOME_KEY: Final = "releaseOutcome"
SINGLE_FLIGHT_CONSTRAINT: Final = "env_leases_active_ws_singleflight_uq"
_REUSABLE: Final = frozenset(
    {
        EnvironmentLease.Policy.REUSE_BY_ENVIRONMENT,
        EnvironmentLease.Policy.REUSE_BY_EXECUTION_WORKSPACE,
    }
)


def _require_provider(actor: Actor) -> UUID:
    agent = actor.agent
    if agent is None or agent.role != agent.Role.PROVIDER:
        raise PermissionDenied("This operation is for provider agents (role provider).")
    return agent.company_id


# --- environments -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EnvironmentCreated:
    environment: Environment


def environment_create(
    *,
    actor: Actor,
    company_id: UUID | str,
    name: str,
    driver: str,
    config: dict[str, Any] | None = None,
) -> EnvironmentCreated:
    """Create an environment of a company the board actor belongs to. Writes one audit row.

    Raises PermissionDenied (not a board actor) or NotFoundError (company not visible).
    """
    if not actor.is_board:
        raise PermissionDenied("This operation is for board members.")
    company = scoped_company(actor, company_id)
    with transaction.atomic(durable=True):
        environment = Environment.objects.create(
            company=company, name=name, driver=driver, config=config or {}
        )
        activity_record(
            company_id=company.pk,
            actor_type=actor.actor_type,
            actor_id=actor.actor_id,
            action="environment.created",
            entity_type="environment",
            entity_id=environment.pk,
            details={"name": name, "driver": driver},
        )
    return EnvironmentCreated(environment=environment)


# --- acquire ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EnvironmentLeaseGrant:
    lease: EnvironmentLease
    created: bool  # False: the same provider allocation was already leased to the run


def environment_lease_acquire(
    *,
    actor: Actor,
    environment_id: UUID,
    heartbeat_run_id: UUID,
    lease_policy: str,
    provider: str,
    provider_lease_id: str,
    execution_workspace_id: UUID | None = None,
    remote_cwd: str | None = None,
    plugin_id: str | None = None,
) -> EnvironmentLeaseGrant:
    """Lease a provider allocation in an environment to a run (status `active`).

    The environment, run and execution workspace must belong to the provider agent's company
    (NotFoundError otherwise, like missing ones). Repeating the acquire of an allocation the
    run already holds actively (same environment, workspace, provider and allocation) returns
    that lease with `created=False` and writes nothing; any other acquire in an archived
    environment is EnvironmentArchived (409). An `ephemeral` lease with a workspace
    is single-flight: while another active ephemeral lease holds the same environment and
    workspace, EnvironmentLeaseSingleFlight (409). Writes one audit row.

    Locks (after the environment, run and workspace are found in the caller's company): the
    advisory key of the (environment, workspace) slot, with a 5 s lock timeout
    (ResourceBusy), then the insert. Two providers racing for one slot: the second waits, then
    sees the first's lease. The partial unique index stays the last line: its violation, in a
    savepoint, becomes the same EnvironmentLeaseSingleFlight.
    """
    company_id = _require_provider(actor)
    with transaction.atomic(durable=True):
        # What the caller names is looked up in its company before the slot's lock is taken:
        # another company's environment is 404 at once, never "busy" behind that company's
        # acquire (which would say it exists), and never holds up that company's slot.
        environment = Environment.objects.filter(pk=environment_id, company_id=company_id).first()
        if environment is None:
            raise EnvironmentNotFound()
        run = HeartbeatRun.objects.filter(pk=heartbeat_run_id, company_id=company_id).first()
        if run is None:
            raise NotFoundError("Heartbeat run not found.")
        if (
            execution_workspace_id is not None
            and not ExecutionWorkspace.objects.filter(
                pk=execution_workspace_id, company_id=company_id
            ).exists()
        ):
            raise NotFoundError("Execution workspace not found.")
        with bounded_lock_wait(resource="environment_lease_slot"):
            advisory_xact_lock(environment_slot_key(environment_id, execution_workspace_id))
        live = EnvironmentLease.objects.filter(
            company_id=company_id,
            environment_id=environment_id,
            execution_workspace_id=execution_workspace_id,
            status=EnvironmentLease.Status.ACTIVE,
        )
        same = live.filter(
            heartbeat_run_id=run.pk,
            provider=provider,
            provider_lease_id=provider_lease_id,
            lease_policy=lease_policy,
        ).first()
        if same is not None:
            return EnvironmentLeaseGrant(lease=same, created=False)
        if environment.status == Environment.Status.ARCHIVED:
            raise EnvironmentArchived(environment_id=str(environment_id))
        single_flight = (
            lease_policy == EnvironmentLease.Policy.EPHEMERAL and execution_workspace_id is not None
        )
        if single_flight:
            holder = _slot_holder(live)
            if holder is not None:
                raise _single_flight(environment_id, execution_workspace_id, holder.pk)
        metadata: dict[str, Any] = {
            "agentId": str(run.agent_id),
            "providerAgentId": actor.actor_id,
        }
        if remote_cwd is not None:
            metadata["remoteCwd"] = remote_cwd
        if plugin_id is not None:
            metadata["pluginId"] = plugin_id
        try:
            with transaction.atomic():  # the savepoint beside the except that recovers from it
                lease = EnvironmentLease.objects.create(
                    company_id=company_id,
                    environment_id=environment_id,
                    execution_workspace_id=execution_workspace_id,
                    issue_id=run.native_issue_id or run.issue_id,
                    heartbeat_run_id=run.pk,
                    status=EnvironmentLease.Status.ACTIVE,
                    lease_policy=lease_policy,
                    provider=provider,
                    provider_lease_id=provider_lease_id,
                    metadata=metadata,
                )
        except IntegrityError as exc:
            if SINGLE_FLIGHT_CONSTRAINT not in str(exc):
                raise
            holder = live.filter(lease_policy=EnvironmentLease.Policy.EPHEMERAL).first()
            raise _single_flight(
                environment_id, execution_workspace_id, holder.pk if holder else None
            ) from exc
        activity_record(
            company_id=company_id,
            actor_type=actor.actor_type,
            actor_id=actor.actor_id,
            action="environment_lease.acquired",
            entity_type="environment_lease",
            entity_id=lease.pk,
            run_id=run.pk,
            details={
                "environmentId": str(environment_id),
                "executionWorkspaceId": (
                    str(execution_workspace_id) if execution_workspace_id else None
                ),
                "leasePolicy": lease_policy,
                "provider": provider,
                "providerLeaseId": provider_lease_id,
            },
        )
        lease.refresh_from_db()
    return EnvironmentLeaseGrant(lease=lease, created=True)


def _slot_holder(live: QuerySet[EnvironmentLease]) -> EnvironmentLease | None:
    """The active ephemeral lease holding the slot, read under the slot's advisory lock."""
    return live.filter(lease_policy=EnvironmentLease.Policy.EPHEMERAL).first()


def _single_flight(
    environment_id: UUID, execution_workspace_id: UUID | None, holder_id: UUID | None
) -> EnvironmentLeaseSingleFlight:
    return EnvironmentLeaseSingleFlight(
        environment_id=str(environment_id),
        execution_workspace_id=str(execution_workspace_id) if execution_workspace_id else None,
        lease_id=str(holder_id) if holder_id else None,
    )


# --- heartbeat ----------------------------------------------------------------------------------


def environment_lease_heartbeat(*, actor: Actor, lease_id: UUID) -> EnvironmentLease:
    """Mark an active lease of the provider's company as used now (`last_used_at`, database
    clock). Bookkeeping with no decision attached, like a runtime-lease renewal: one guarded
    UPDATE (its row lock waits at most 5 s behind a release: ResourceBusy), no audit row.

    Raises EnvironmentLeaseNotFound (also another company's), EnvironmentLeaseNotActive,
    ResourceBusy.
    """
    company_id = _require_provider(actor)
    with transaction.atomic(durable=True), bounded_lock_wait(resource="environment_lease"):
        touched = EnvironmentLease.objects.filter(
            pk=lease_id, company_id=company_id, status=EnvironmentLease.Status.ACTIVE
        ).update(last_used_at=Now())
        lease = EnvironmentLease.objects.filter(pk=lease_id, company_id=company_id).first()
        if lease is None:
            raise EnvironmentLeaseNotFound()
        if not touched:
            raise _not_active(lease)
    return lease


def _not_active(lease: EnvironmentLease) -> EnvironmentLeaseNotActive:
    metadata = lease.metadata if isinstance(lease.metadata, dict) else {}
    recorded = metadata.get(RELEASE_OUTCOME_KEY)
    return EnvironmentLeaseNotActive(
        status=lease.status, outcome=recorded if isinstance(recorded, str) else None
    )


# --- release ------------------------------------------------------------------------------------


ReleaseRule = Literal["policy", "export_resume_kept", "export_resume_preserved"]


@dataclass(frozen=True, slots=True)
class EnvironmentLeaseRelease:
    lease: EnvironmentLease
    released: bool  # False: an idempotent repeat (same outcome), nothing written
    rule: ReleaseRule | None  # which rule decided the new status (None on a repeat)


def _policy_status(policy: str, outcome: Outcome) -> str:
    if policy in _REUSABLE:
        return EnvironmentLease.Status.RELEASED
    if policy == EnvironmentLease.Policy.RETAIN_ON_FAILURE and outcome == "failed":
        return EnvironmentLease.Status.RETAINED
    return EnvironmentLease.Status.PENDING_CLEANUP


def _accepted_result_id(lease: EnvironmentLease) -> UUID | None:
    if lease.heartbeat_run_id is None:
        return None
    run = HeartbeatRun.objects.filter(
        pk=lease.heartbeat_run_id, company_id=lease.company_id
    ).first()
    if run is None or run.completion_contract_id is None:
        return None
    return (
        NativeRunResult.objects.filter(
            company_id=run.company_id,
            run_id=run.pk,
            completion_contract_id=run.completion_contract_id,
            schema_status=NativeRunResult.SchemaStatus.ACCEPTED,
        )
        .order_by("-created_at", "pk")
        .values_list("pk", flat=True)
        .first()
    )


def _release_locked(
    lease: EnvironmentLease,
    *,
    outcome: Outcome,
    actor_type: str,
    actor_id: str,
    action: str,
    extra: dict[str, Any] | None = None,
) -> tuple[EnvironmentLease, ReleaseRule]:
    """Release an active lease already locked by the caller: the export-resume marker rules,
    then the policy (module docstring); one audit row `action` (with `extra` in its details),
    and a marker retired or preserved on the way writes its own row too. The one release path,
    shared by the provider's release and the board's force release.
    """
    require_transaction()
    rule: ReleaseRule = "policy"
    marker_result: str | None = None
    if export_resume_has(lease):
        retired = export_resume_release_completed(
            lease_id=lease.pk, actor_type=actor_type, actor_id=actor_id
        )
        marker_result = retired.reason
        if retired.released and retired.lease is not None:
            lease = retired.lease
        else:
            rule = "export_resume_kept"
    elif outcome == "failed" and lease.heartbeat_run_id is not None:
        preserved = export_resume_preserve(
            run_id=lease.heartbeat_run_id,
            result_id=_accepted_result_id(lease),
            actor_type=actor_type,
            actor_id=actor_id,
            lease_id=lease.pk,
        )
        if preserved is not None:
            lease, rule = preserved.lease, "export_resume_preserved"

    metadata = dict(lease.metadata) if isinstance(lease.metadata, dict) else {}
    metadata[RELEASE_OUTCOME_KEY] = outcome
    changes: dict[str, Any] = {"released_at": Now(), "updated_at": Now()}
    if rule == "export_resume_preserved":
        pass  # export_resume_preserve already made it a stop-only pending cleanup
    elif rule == "export_resume_kept":
        # Retained allocations are never cleaned up automatically, so the marker may stay
        # on one; any other release would free the allocation for reuse or destruction,
        # so it becomes a stop-only pending cleanup instead.
        if _policy_status(lease.lease_policy, outcome) == EnvironmentLease.Status.RETAINED:
            changes.update(status=EnvironmentLease.Status.RETAINED)
        else:
            changes.update(
                status=EnvironmentLease.Status.PENDING_CLEANUP,
                cleanup_status=EnvironmentLease.CleanupStatus.PENDING,
            )
        changes["failure_reason"] = EXPORT_STOP_PENDING
    else:
        status = _policy_status(lease.lease_policy, outcome)
        changes["status"] = status
        if status == EnvironmentLease.Status.PENDING_CLEANUP:
            changes["cleanup_status"] = EnvironmentLease.CleanupStatus.PENDING
    if changes.get("status") == EnvironmentLease.Status.PENDING_CLEANUP:
        metadata.update(
            pendingCleanupInFlight=False,
            pendingCleanupLeaseExpiresAtMs=0,
            pendingCleanupRetryAfterMs=0,
            pendingCleanupRetryAttempts=0,
        )
    EnvironmentLease.objects.filter(pk=lease.pk).update(metadata=metadata, **changes)
    lease.refresh_from_db()
    activity_record(
        company_id=lease.company_id,
        actor_type=actor_type,
        actor_id=actor_id,
        action=action,
        entity_type="environment_lease",
        entity_id=lease.pk,
        run_id=lease.heartbeat_run_id,
        details={
            "outcome": outcome,
            "leasePolicy": lease.lease_policy,
            "rule": rule,
            "exportResume": marker_result,
            "status": lease.status,
            "cleanupStatus": lease.cleanup_status,
            **(extra or {}),
        },
    )
    return lease, rule


def environment_lease_release(
    *, actor: Actor, lease_id: UUID, outcome: Outcome
) -> EnvironmentLeaseRelease:
    """Release an active lease of the provider's company with the run's outcome; the policy
    and the export-resume marker rules decide the new status (module docstring).

    Repeating the release with the recorded outcome returns the lease as it is now and writes
    nothing; another outcome, or a lease that was never released over this API, is
    EnvironmentLeaseNotActive. Writes one audit row (`environment_lease.released`); a marker
    retired or preserved on the way writes its own row too (each is its own change).

    Locks: the lease row FOR NO KEY UPDATE with a 5 s lock timeout (ResourceBusy); a cleanup
    claim racing the release waits for it and then sees the pending cleanup (or, first, finds
    the lease active: `cleanup_not_pending`). Raises EnvironmentLeaseNotFound (also another
    company's), EnvironmentLeaseNotActive, ResourceBusy.
    """
    company_id = _require_provider(actor)
    with transaction.atomic(durable=True):
        with bounded_lock_wait(resource="environment_lease"):
            lease = (
                environment_leases_for_update().filter(pk=lease_id, company_id=company_id).first()
            )
        if lease is None:
            raise EnvironmentLeaseNotFound()
        if lease.status != EnvironmentLease.Status.ACTIVE:
            metadata = lease.metadata if isinstance(lease.metadata, dict) else {}
            if metadata.get(RELEASE_OUTCOME_KEY) == outcome:
                return EnvironmentLeaseRelease(lease=lease, released=False, rule=None)
            raise _not_active(lease)

        lease, rule = _release_locked(
            lease,
            outcome=outcome,
            actor_type=actor.actor_type,
            actor_id=actor.actor_id,
            action="environment_lease.released",
        )
    return EnvironmentLeaseRelease(lease=lease, released=True, rule=rule)


def environment_lease_force_release(
    *,
    company_ids: frozenset[UUID] | None,
    lease_id: UUID,
    actor_type: str,
    actor_id: str,
    reason: str,
) -> EnvironmentLeaseRelease:
    """The board's force release of an active lease whose provider will not release it (its
    run ended or its agent is gone): released with outcome `failed` through the same path as
    the provider's release, so the policy and the export-resume marker rules decide the new
    status exactly as theirs would (a `retain_on_failure` lease is retained, an ephemeral one
    goes to cleanup, a pending export is only ever stopped). One audit row
    (`environment_lease.force_released`, with `reason`); a marker retired or preserved on the
    way writes its own row too.

    A lease that is no longer active (released by its provider, or forced before) answers
    `released=False` and writes nothing, whatever its recorded outcome.

    `company_ids` limits which leases the actor may see (None: all). Locks: the lease row FOR
    NO KEY UPDATE with a 5 s lock timeout. Raises EnvironmentLeaseNotFound (also another
    company's), ResourceBusy.
    """
    with transaction.atomic(durable=True):
        with bounded_lock_wait(resource="environment_lease"):
            lease = environment_leases_for_update().filter(pk=lease_id).first()
        if lease is None or (company_ids is not None and lease.company_id not in company_ids):
            raise EnvironmentLeaseNotFound()
        if lease.status != EnvironmentLease.Status.ACTIVE:
            return EnvironmentLeaseRelease(lease=lease, released=False, rule=None)
        lease, rule = _release_locked(
            lease,
            outcome="failed",
            actor_type=actor_type,
            actor_id=actor_id,
            action="environment_lease.force_released",
            extra={"reason": reason},
        )
    return EnvironmentLeaseRelease(lease=lease, released=True, rule=rule)
