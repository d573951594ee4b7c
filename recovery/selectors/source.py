"""Recovery-source inspection (docs/recovery.md#recovery-source-inspection): resolve only the
immutable workspace source a failed run recorded, and prove nobody else can still write to it.

Never discovers a source by recency, mutable configuration or a provider search: lease ids come
only from the run's restore record, its own sync reference (export causes) or the action's
historical-source evidence, and every lease must be bound to that exact run. Checks run in a
fixed order (docs/recovery.md#recovery-source-checks-in-order) and the first failure wins, so an
operator always sees the most fundamental problem first.

Decisions this service makes itself (docs/recovery.md#recovery-source-checks-in-order):
- Executing in this process (`adapterExecutionControls`): this service hosts no in-process
  adapters, so nothing registers and a run is never "executing here". The registry below
  (`adapter_execution_control`) exists for any future in-process executor; it is per process.
- `hasMigratedLegacyWorkspaceSource`: true only when the run's `result_json` carries a
  `legacyWorkspaceSourceMigration` record (schema `paperclip.legacy-workspace-source-migration.v1`)
  naming this company, run, lease and descriptor digest; otherwise false.
- Remote workspace authority: `execution_workspaces.metadata.remoteWorkspaceAuthority`
  (`{epoch, dirty, writerRunId, snapshotId, location: {leaseId, providerLeaseId, remoteCwd,
  environmentId}}`).
- `retired_reusable_lease_predecessors`: the hand-off rule is defined in its docstring.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol, cast
from uuid import UUID

from django.db import connection, transaction
from django.db.models import Q

from leases.environment.export_resume.markers import stop_only_cleanup_read
from leases.environment.export_resume.sync_reference import (
    NativeWorkspaceSyncReference,
    read_native_workspace_sync_reference,
)
from leases.models import EnvironmentLease
from paperclip.db.clock import db_now
from paperclip.ids import is_uuid
from paperclip.models import (
    Environment,
    ExecutionWorkspace,
    ExecutionWorkspaceSnapshot,
    HeartbeatRun,
    NativeRunFinalization,
    NativeRunResult,
)
from recovery.errors import (
    SourceFailure,
    SourceInspectionLimit,
    binding_failure,
)
from recovery.models import IssueRecoveryAction

WORKSPACE_EXPORT_CAUSES: Final = (
    "native_workspace_sync_out_unrecoverable",
    "native_workspace_sync_out_retry_exhausted",
)
RETAINED_POLICIES: Final = ("retain_on_failure", "ephemeral")
REUSABLE_POLICIES: Final = ("reuse_by_environment", "reuse_by_execution_workspace")
SETTLED_COORDINATOR_PHASES: Final = ("committed", "terminal_failure", "applied")
RESTORE_RECOVERY_SCHEMA: Final = "paperclip.workspace-restore-recovery.v1"
HISTORICAL_SOURCE_SCHEMA: Final = "paperclip.historical-workspace-source.v1"
LEGACY_MIGRATION_SCHEMA: Final = "paperclip.legacy-workspace-source-migration.v1"
REMOTE_AUTHORITY_KEY: Final = "remoteWorkspaceAuthority"
# How many sources the board API and the admin panel inspect at most per request.
MAXIMUM_SOURCES: Final = 50


def _as_dict(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# --- Remote workspace reference and authority ---------------------------------------------


@dataclass(frozen=True, slots=True)
class RemoteWorkspaceReference:
    """`runner_profile_json.remoteWorkspace`: a remote run's workspace reference."""

    workspace_id: str
    lease_id: str
    provider_lease_id: str
    remote_cwd: str
    epoch: int
    state: Literal["prepared", "saved"]
    snapshot_id: str | None

    def as_json(self) -> dict[str, Any]:
        return {
            "workspaceId": self.workspace_id,
            "leaseId": self.lease_id,
            "providerLeaseId": self.provider_lease_id,
            "remoteCwd": self.remote_cwd,
            "epoch": self.epoch,
            "state": self.state,
            "snapshotId": self.snapshot_id,
        }


def read_remote_workspace_reference(value: object) -> RemoteWorkspaceReference | None:
    """Strict parser: uuid `workspaceId`; string `leaseId`, `providerLeaseId`, `remoteCwd`;
    integer `epoch` >= 0; `state` prepared|saved; `snapshotId` a uuid (required when saved)
    or null/absent. None on any deviation."""
    if not isinstance(value, Mapping):
        return None
    strings = [value.get(k) for k in ("leaseId", "providerLeaseId", "remoteCwd")]
    state, snapshot = value.get("state"), value.get("snapshotId")
    if (
        not is_uuid(value.get("workspaceId"))
        or any(not isinstance(s, str) for s in strings)
        or not _is_count(value.get("epoch"))
        or state not in ("prepared", "saved")
        or (snapshot is not None and not is_uuid(snapshot))
        or (state == "saved" and snapshot is None)
    ):
        return None
    lease_id, provider_lease_id, remote_cwd = (str(s) for s in strings)
    return RemoteWorkspaceReference(
        workspace_id=str(value["workspaceId"]),
        lease_id=lease_id,
        provider_lease_id=provider_lease_id,
        remote_cwd=remote_cwd,
        epoch=int(value["epoch"]),
        state=state,
        snapshot_id=snapshot,
    )


@dataclass(frozen=True, slots=True)
class RemoteWorkspaceLocation:
    lease_id: str
    provider_lease_id: str
    remote_cwd: str
    environment_id: str | None


@dataclass(frozen=True, slots=True)
class RemoteWorkspaceAuthority:
    epoch: int
    dirty: bool
    writer_run_id: str | None
    snapshot_id: str | None
    location: RemoteWorkspaceLocation | None


def read_remote_workspace_authority(metadata: object) -> RemoteWorkspaceAuthority | None:
    """The execution workspace's remote authority record, or None when absent or malformed.
    A record without a valid `location` parses with `location=None` (it cannot vouch)."""
    record = _as_dict(metadata).get(REMOTE_AUTHORITY_KEY)
    if not isinstance(record, dict):
        return None
    epoch, dirty = record.get("epoch"), record.get("dirty")
    writer, snapshot = record.get("writerRunId"), record.get("snapshotId")
    if (
        not _is_count(epoch)
        or not isinstance(dirty, bool)
        or not (writer is None or isinstance(writer, str))
        or not (snapshot is None or isinstance(snapshot, str))
    ):
        return None
    raw = record.get("location")
    location = None
    if isinstance(raw, dict):
        fields = [raw.get(k) for k in ("leaseId", "providerLeaseId", "remoteCwd")]
        env = raw.get("environmentId")
        if all(isinstance(f, str) for f in fields) and (env is None or isinstance(env, str)):
            location = RemoteWorkspaceLocation(str(fields[0]), str(fields[1]), str(fields[2]), env)
    return RemoteWorkspaceAuthority(cast(int, epoch), dirty, writer, snapshot, location)


def _remote_reference_agrees(
    reference: RemoteWorkspaceReference,
    authority: RemoteWorkspaceAuthority | None,
    run_id: UUID,
) -> bool:
    if authority is None or authority.location is None:
        return False
    location = authority.location
    if (
        authority.epoch != reference.epoch
        or location.lease_id != reference.lease_id
        or location.provider_lease_id != reference.provider_lease_id
        or location.remote_cwd != reference.remote_cwd
    ):
        return False
    if reference.state == "prepared":
        return authority.dirty and authority.writer_run_id == str(run_id)
    return (
        not authority.dirty
        and authority.writer_run_id is None
        and authority.snapshot_id == reference.snapshot_id
    )


# --- In-process execution registry (see module docstring) ----------------------------------

_executing_runs: set[str] = set()
_executing_guard = threading.Lock()


@contextmanager
def adapter_execution_control(run_id: UUID | str) -> Iterator[None]:
    """Mark `run_id` as executing in this process for the duration of the block."""
    key = str(run_id)
    with _executing_guard:
        _executing_runs.add(key)
    try:
        yield
    finally:
        with _executing_guard:
            _executing_runs.discard(key)


def adapter_executing(run_id: UUID | str) -> bool:
    with _executing_guard:
        return str(run_id) in _executing_runs


def has_migrated_legacy_workspace_source(
    *, company_id: UUID, run: HeartbeatRun, reference: NativeWorkspaceSyncReference
) -> bool:
    """True only when the run records that this exact legacy source was migrated (module
    docstring); the source is then returned for preservation only."""
    record = _as_dict(run.result_json).get("legacyWorkspaceSourceMigration")
    return (
        isinstance(record, dict)
        and record.get("schema") == LEGACY_MIGRATION_SCHEMA
        and record.get("companyId") == str(company_id)
        and record.get("runId") == str(run.pk)
        and record.get("leaseId") == reference.lease_id
        and record.get("descriptorSha256") == reference.descriptor_sha256
    )


# --- Hand-off history ------------------------------------------------------------------------


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


# --- Inspection ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RecoverySource:
    lease: EnvironmentLease
    environment: Environment
    reference: NativeWorkspaceSyncReference | None
    preservation_only: bool
    remote_reference: RemoteWorkspaceReference | None
    remote_workspace: ExecutionWorkspace | None
    remote_cwd: str


@dataclass(frozen=True, slots=True)
class RecoverySourceInspection:
    run: HeartbeatRun
    action: IssueRecoveryAction
    sources: tuple[RecoverySource, ...]


def recovery_source_inspect(
    *,
    company_id: UUID,
    issue_id: UUID,
    run_id: UUID,
    action_id: UUID,
    maximum_sources: int | None = None,
) -> RecoverySourceInspection:
    """Resolve the workspace source recorded by the failed run `run_id` for recovery action
    `action_id` on issue `issue_id`; read-only.

    Runs in one REPEATABLE READ, READ ONLY transaction (or the caller's), so every check sees
    the same snapshot. Takes no locks. Raises SourceFailure (`source_binding_invalid` with a
    reason, `historical_source_missing`, `agent_stop_unconfirmed`,
    `allocation_ownership_ambiguous`, `workspace_writer_active`, `source_unavailable`) or
    SourceInspectionLimit when more than `maximum_sources` leases are recorded.
    """
    if connection.in_atomic_block:
        return _inspect(company_id, issue_id, run_id, action_id, maximum_sources)
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        return _inspect(company_id, issue_id, run_id, action_id, maximum_sources)


def _ambiguous() -> SourceFailure:
    return SourceFailure("allocation_ownership_ambiguous", "service_required")


def _inspect(
    company_id: UUID,
    issue_id: UUID,
    run_id: UUID,
    action_id: UUID,
    maximum_sources: int | None,
) -> RecoverySourceInspection:
    """The checks, in the documented order (docs/recovery.md), one step each."""
    run, action, evidence = _bound_run_and_action(company_id, issue_id, run_id, action_id)
    refs = _workspace_references(company_id, run)  # 1. the run's own workspace references
    lease_ids = _recorded_lease_ids(  # 2. which leases the run recorded as its source
        run, action, evidence, refs.recovery_reference, maximum_sources
    )
    now = db_now()
    coordinator = _require_nobody_driving(company_id, run, now)  # 3. nobody drives the run
    accepted_export = _accepted_export(  # 4. a completed native result still owed copy-back
        company_id, issue_id, run, action, coordinator, refs.recovery_reference
    )
    sources = tuple(  # 5. every recorded lease, strictly
        _inspect_lease(
            lease_key,
            company_id=company_id,
            issue_id=issue_id,
            run=run,
            refs=refs,
            accepted_export=accepted_export,
            now=now,
        )
        for lease_key in lease_ids
    )
    return RecoverySourceInspection(run=run, action=action, sources=sources)


@dataclass(frozen=True, slots=True)
class _References:
    """The workspace references the run recorded in its runner profile."""

    reference: NativeWorkspaceSyncReference | None  # a legacy native sync reference
    remote: RemoteWorkspaceReference | None  # a remote workspace reference
    remote_workspace: ExecutionWorkspace | None
    authority: RemoteWorkspaceAuthority | None

    @property
    def recovery_reference(self) -> NativeWorkspaceSyncReference | RemoteWorkspaceReference | None:
        return self.reference or self.remote


def _bound_run_and_action(
    company_id: UUID, issue_id: UUID, run_id: UUID, action_id: UUID
) -> tuple[HeartbeatRun, IssueRecoveryAction, dict[str, Any]]:
    """The terminal run and the recovery action that names it, both bound to the issue."""
    invalid = binding_failure
    run = HeartbeatRun.objects.filter(company_id=company_id, pk=run_id).first()
    action = IssueRecoveryAction.objects.filter(
        company_id=company_id, source_issue_id=issue_id, pk=action_id
    ).first()
    if run is None:
        raise invalid("source_run_missing")
    if action is None:
        raise invalid("recovery_action_missing")
    evidence = _as_dict(action.evidence)
    if evidence.get("runId") != str(run.pk):
        raise invalid("recovery_action_run_mismatch")
    if run.status not in HeartbeatRun.TERMINAL_STATUSES:
        raise invalid("source_run_not_terminal")
    bound_issue: object = run.native_issue_id or run.issue_id
    if bound_issue is None:
        bound_issue = _as_dict(run.context_snapshot).get("issueId")
    if bound_issue is None or str(bound_issue) != str(issue_id):
        raise invalid("source_issue_mismatch")
    return run, action, evidence


def _workspace_references(company_id: UUID, run: HeartbeatRun) -> _References:
    """At most one well-formed reference; a remote one must agree with its workspace's
    authority and, once saved, name a committed snapshot."""
    invalid = binding_failure
    profile = _as_dict(run.runner_profile_json)
    raw_reference = profile.get("nativeWorkspaceSync")
    reference = read_native_workspace_sync_reference(raw_reference)
    if raw_reference is not None and reference is None:
        raise invalid("native_reference_invalid")
    raw_remote = profile.get("remoteWorkspace")
    remote = read_remote_workspace_reference(raw_remote)
    if (raw_remote is not None and remote is None) or (reference and remote):
        raise invalid("native_reference_invalid")
    remote_workspace: ExecutionWorkspace | None = None
    authority: RemoteWorkspaceAuthority | None = None
    if remote is not None:
        remote_workspace = ExecutionWorkspace.objects.filter(
            company_id=company_id, pk=UUID(remote.workspace_id)
        ).first()
        authority = read_remote_workspace_authority(
            remote_workspace.metadata if remote_workspace is not None else None
        )
        if remote_workspace is None or not _remote_reference_agrees(remote, authority, run.pk):
            raise invalid("workspace_reference_mismatch")
        if remote.state == "saved":
            committed = remote.snapshot_id is not None and (
                ExecutionWorkspaceSnapshot.objects.filter(
                    company_id=company_id,
                    execution_workspace_id=remote_workspace.pk,
                    pk=UUID(remote.snapshot_id),
                    status="committed",
                ).exists()
            )
            if not committed:
                raise invalid("workspace_reference_mismatch")
    return _References(reference, remote, remote_workspace, authority)


def _recorded_lease_ids(
    run: HeartbeatRun,
    action: IssueRecoveryAction,
    evidence: dict[str, Any],
    recovery_reference: NativeWorkspaceSyncReference | RemoteWorkspaceReference | None,
    maximum_sources: int | None,
) -> list[str]:
    """The lease ids the run recorded: its restore record, else an export's own reference,
    else the action's historical source; distinct UUIDs that include the reference's."""
    invalid = binding_failure
    recorded = _as_dict(run.result_json).get("workspaceRestoreRecovery")
    if recorded is not None and _as_dict(recorded).get("schema") != RESTORE_RECOVERY_SCHEMA:
        raise invalid("restore_reference_invalid")
    historical = evidence.get("historicalWorkspaceSource")
    if historical is not None and (
        _as_dict(historical).get("schema") != HISTORICAL_SOURCE_SCHEMA
        or _as_dict(historical).get("runId") != str(run.pk)
    ):
        raise invalid("historical_reference_invalid")
    lease_ids: object
    if recorded is not None:
        lease_ids = _as_dict(recorded).get("leaseIds")
    elif recovery_reference is not None and action.cause in WORKSPACE_EXPORT_CAUSES:
        lease_ids = [recovery_reference.lease_id]
    else:
        lease_ids = _as_dict(historical).get("leaseIds")
    if not isinstance(lease_ids, list) or not lease_ids:
        raise SourceFailure("historical_source_missing", "use_alternative_strategy")
    if maximum_sources is not None and len(lease_ids) > maximum_sources:
        raise SourceInspectionLimit(maximum_sources=maximum_sources, recorded=len(lease_ids))
    if (
        any(not is_uuid(item) for item in lease_ids)
        or len(set(lease_ids)) != len(lease_ids)
        or (recovery_reference is not None and recovery_reference.lease_id not in lease_ids)
    ):
        raise invalid("lease_reference_invalid")
    return lease_ids


def _controller_lease_live(coordinator: NativeRunFinalization | None, now: Any) -> bool:
    """The run's controller lease (held in its coordinator) is held and not lapsed on the
    database clock."""
    return (
        coordinator is not None
        and bool(coordinator.lease_owner)
        and (coordinator.lease_expires_at is None or coordinator.lease_expires_at > now)
    )


def _require_nobody_driving(
    company_id: UUID, run: HeartbeatRun, now: Any
) -> NativeRunFinalization | None:
    """No executing adapter and no live controller lease (the coordinator's own lease, which
    the controller-lease service keeps and a terminal run ends): the run's coordinator, if
    any."""
    coordinator = NativeRunFinalization.objects.filter(company_id=company_id, run_id=run.pk).first()
    if _controller_lease_live(coordinator, now) or adapter_executing(run.pk):
        raise SourceFailure("agent_stop_unconfirmed", "recheck_evidence")
    return coordinator


def _accepted_export(
    company_id: UUID,
    issue_id: UUID,
    run: HeartbeatRun,
    action: IssueRecoveryAction,
    coordinator: NativeRunFinalization | None,
    recovery_reference: NativeWorkspaceSyncReference | RemoteWorkspaceReference | None,
) -> bool:
    """Reusable allocations can still owe copy-back for a completed native result. This
    authorizes preservation of the exact descriptor only, never reuse for agent execution."""
    return bool(
        recovery_reference is not None
        and action.cause in WORKSPACE_EXPORT_CAUSES
        and run.runtime_mode == HeartbeatRun.RuntimeMode.NATIVE
        and coordinator is not None
        and coordinator.issue_id == issue_id
        and coordinator.result_id is not None
        and run.completion_contract_id is not None
        and NativeRunResult.objects.filter(
            company_id=company_id,
            issue_id=issue_id,
            run_id=run.pk,
            pk=coordinator.result_id,
            completion_contract_id=run.completion_contract_id,
            schema_status=NativeRunResult.SchemaStatus.ACCEPTED,
            result_json__terminal__runTerminalState="succeeded",
        ).exists()
    )


def _inspect_lease(
    lease_key: str,
    *,
    company_id: UUID,
    issue_id: UUID,
    run: HeartbeatRun,
    refs: _References,
    accepted_export: bool,
    now: Any,
) -> RecoverySource:
    """One recorded lease, strictly: bound to the run and issue, retained (or a reusable
    export), matching the descriptor, its allocation's history unambiguous, no writer active
    on the workspace, and its environment present."""
    invalid = binding_failure
    reference, remote, authority = refs.reference, refs.remote, refs.authority
    lease = EnvironmentLease.objects.filter(
        company_id=company_id, pk=UUID(lease_key), heartbeat_run_id=run.pk
    ).first()
    legacy_descriptor = reference if reference and reference.lease_id == lease_key else None
    remote_descriptor = remote if remote and remote.lease_id == lease_key else None
    descriptor = legacy_descriptor or remote_descriptor
    if lease is None:
        raise invalid("source_lease_not_bound")
    metadata = _as_dict(lease.metadata)
    remote_cwd = metadata.get("remoteCwd")
    if lease.issue_id != issue_id:
        raise invalid("lease_issue_mismatch")
    if lease.environment_id is None:
        raise invalid("lease_environment_missing")
    if not lease.provider_lease_id:
        raise invalid("lease_allocation_missing")
    if not lease.provider or lease.provider == "local":
        raise invalid("lease_provider_invalid")
    reusable_export = (
        descriptor is not None
        and (accepted_export or (remote_descriptor is not None and authority is not None))
        and lease.lease_policy in REUSABLE_POLICIES
    )
    if lease.lease_policy not in RETAINED_POLICIES and not reusable_export:
        raise invalid("lease_policy_not_retained", lease.lease_policy)
    if not isinstance(remote_cwd, str) or not remote_cwd.startswith("/"):
        raise invalid("lease_cwd_invalid")
    if descriptor is not None and lease.provider_lease_id != descriptor.provider_lease_id:
        raise invalid("allocation_reference_mismatch")
    if descriptor is not None and remote_cwd != descriptor.remote_cwd:
        raise invalid("cwd_reference_mismatch")
    if (
        descriptor is not None
        and lease.execution_workspace_id is not None
        and str(lease.execution_workspace_id) != descriptor.workspace_id
    ):
        raise invalid("workspace_reference_mismatch")
    if remote_descriptor is not None:
        location = authority.location if authority is not None else None
        if location is None or str(lease.environment_id) != location.environment_id:
            raise invalid("workspace_reference_mismatch")

    history = list(
        EnvironmentLease.objects.exclude(pk=lease.pk).filter(
            provider=lease.provider, provider_lease_id=lease.provider_lease_id
        )
    )
    predecessors = retired_reusable_lease_predecessors(lease, history)
    if predecessors is None:
        raise _ambiguous()
    if predecessors:
        if (
            (run.runtime_mode != HeartbeatRun.RuntimeMode.NATIVE and remote_descriptor is None)
            or descriptor is None
            or metadata.get("agentId") != str(run.agent_id)
        ):
            raise _ambiguous()
        _check_predecessors(
            predecessors,
            company_id=company_id,
            issue_id=issue_id,
            run=run,
            descriptor=descriptor,
            remote_descriptor=remote_descriptor,
            provider_lease_id=lease.provider_lease_id,
            remote_cwd=remote_cwd,
            now=now,
        )

    # Snapshot export writes only a new staging directory; a native baseline merge also
    # needs exclusive ownership of its host destination.
    if descriptor is not None and _writer_active(
        company_id=company_id,
        issue_key=str(issue_id),
        run=run,
        workspace_id=descriptor.workspace_id,
    ):
        raise SourceFailure("workspace_writer_active", "recheck_evidence")

    environment = Environment.objects.filter(pk=lease.environment_id).first()
    if environment is None:
        raise SourceFailure("source_unavailable", "service_required")
    preservation_only = legacy_descriptor is not None and has_migrated_legacy_workspace_source(
        company_id=company_id, run=run, reference=legacy_descriptor
    )
    return RecoverySource(
        lease=lease,
        environment=environment,
        reference=legacy_descriptor,
        preservation_only=preservation_only,
        remote_reference=remote_descriptor,
        remote_workspace=refs.remote_workspace if remote_descriptor is not None else None,
        remote_cwd=remote_cwd,
    )


def _check_predecessors(
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
            raise _ambiguous()
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
            or _controller_lease_live(owner, now)
            or owner.phase not in SETTLED_COORDINATOR_PHASES
        ):
            raise _ambiguous()
        profile = _as_dict(prior.runner_profile_json)
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
            raise _ambiguous()


def _writer_active(
    *, company_id: UUID, issue_key: str, run: HeartbeatRun, workspace_id: str
) -> bool:
    """A queued or running run targets the issue or the descriptor's workspace, other than the
    explicit fresh-isolated continuation an action of this issue recorded for this run."""
    continuations: set[UUID] = set()
    for evidence in IssueRecoveryAction.objects.filter(
        company_id=company_id, source_issue_id=UUID(issue_key), evidence__runId=str(run.pk)
    ).values_list("evidence", flat=True):
        continuation = _as_dict(_as_dict(evidence).get("explicitUserContinuation"))
        readiness = _as_dict(continuation.get("readiness"))
        continuation_run = continuation.get("runId")
        # Exactly the run's id as text, not any spelling of it
        # (docs/recovery.md#issue-id-resolution).
        if (
            readiness.get("mode") == "fresh_isolated_workspace"
            and is_uuid(continuation_run)
            and str(UUID(continuation_run)) == continuation_run
        ):
            continuations.add(UUID(continuation_run))
    targets = (
        Q(native_issue_id=UUID(issue_key))
        | Q(issue_id=UUID(issue_key))
        | Q(context_snapshot__issueId=issue_key)
        | Q(context_snapshot__executionWorkspaceId=workspace_id)
    )
    if is_uuid(workspace_id):
        # Our runs also carry the workspace as a column: match that too.
        targets |= Q(execution_workspace_id=UUID(workspace_id))
    return (
        HeartbeatRun.objects.filter(company_id=company_id, status__in=HeartbeatRun.LIVE_STATUSES)
        .filter(targets)
        .exclude(pk__in=continuations)
        .exists()
    )


# --- The preservation owner's own lease ----------------------------------------------------


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
    metadata = _as_dict(source.lease.metadata)
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


# --- Admin panel ----------------------------------------------------------------------------
