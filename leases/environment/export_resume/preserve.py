"""`export_resume_preserve`: tag a run's prepared export lease as stop-only, inside the
finalizer's transaction, before its terminal failure is visible."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from uuid import UUID

from django.db.models.functions import Now

from leases.environment.export_resume.binding import lease_metadata
from leases.environment.export_resume.keys import (
    EXPORT_RESUME_KEY,
    EXPORT_RESUME_V2,
    EXPORT_STOP_PENDING,
    REMOTE_TERMINATION_KEY,
    SYSTEM_ACTOR_ID,
    SYSTEM_ACTOR_TYPE,
)
from leases.environment.export_resume.sync_reference import read_native_workspace_sync_reference
from leases.environment.locks import environment_leases_for_update
from leases.models import EnvironmentLease
from paperclip.activity import activity_record
from paperclip.db.locking import require_transaction
from paperclip.ids import parse_uuid
from paperclip.models import HeartbeatRun, NativeRunResult


@dataclass(frozen=True, slots=True)
class ExportResumePreserved:
    lease: EnvironmentLease
    request_id: str


def export_resume_preserve(
    *,
    run_id: UUID,
    result_id: UUID | None,
    actor_type: str = SYSTEM_ACTOR_TYPE,
    actor_id: str = SYSTEM_ACTOR_ID,
    lease_id: UUID | None = None,
) -> ExportResumePreserved | None:
    """Tag the run's prepared export lease as stop-only before a terminal failure is visible.

    Must run inside the finalizer's transaction (a crash then cannot expose an untagged failed
    lease to orphan cleanup). Acts only when the run's sync reference is `prepared`,
    `result_id` is an *accepted* result of this run and its completion contract, and the
    referenced lease (id, company, run, allocation) is `active`. Then: status
    `pending_cleanup`, cleanup `failed`, failure `workspace_export_stop_pending`,
    `released_at` now, old termination receipt removed, a v2 marker with a fresh request id
    pinned to the lease's plugin, and the pending-cleanup bookkeeping reset (attempt id = the
    request id, not in flight, retry counters zero). Writes one audit row.

    `lease_id` (a release of that lease): only when the reference names that lease; a run's
    other lease released `failed` never touches its export lease.

    Locks: the lease row FOR NO KEY UPDATE. Returns None when it did nothing.
    """
    require_transaction()
    run = HeartbeatRun.objects.filter(pk=run_id).first()
    if run is None or result_id is None or run.completion_contract_id is None:
        return None
    profile = run.runner_profile_json if isinstance(run.runner_profile_json, dict) else {}
    reference = read_native_workspace_sync_reference(profile.get("nativeWorkspaceSync"))
    lease_pk = parse_uuid(reference.lease_id) if reference is not None else None
    if reference is None or reference.state != "prepared" or lease_pk is None:
        return None
    if lease_id is not None and lease_pk != lease_id:
        return None
    accepted = NativeRunResult.objects.filter(
        pk=result_id,
        company_id=run.company_id,
        run_id=run.pk,
        completion_contract_id=run.completion_contract_id,
        schema_status=NativeRunResult.SchemaStatus.ACCEPTED,
    ).exists()
    if not accepted:
        return None
    lease = (
        environment_leases_for_update()
        .filter(
            pk=lease_pk,
            company_id=run.company_id,
            heartbeat_run_id=run.pk,
            provider_lease_id=reference.provider_lease_id,
        )
        .first()
    )
    if lease is None or lease.status != EnvironmentLease.Status.ACTIVE:
        return None
    request_id = str(uuid.uuid4())
    metadata = {k: v for k, v in lease_metadata(lease).items() if k != REMOTE_TERMINATION_KEY}
    metadata[EXPORT_RESUME_KEY] = {
        "schema": EXPORT_RESUME_V2,
        "requestId": request_id,
        "purpose": "terminal_export",
        "companyId": str(run.company_id),
        "runId": str(run.pk),
        "resultId": str(result_id),
        "leaseId": str(lease.pk),
        "provider": lease.provider,
        "providerLeaseId": lease.provider_lease_id,
        "pluginId": metadata.get("pluginId"),
    }
    metadata.update(
        pendingCleanupAttemptId=request_id,
        pendingCleanupInFlight=False,
        pendingCleanupLeaseExpiresAtMs=0,
        pendingCleanupRetryAfterMs=0,
        pendingCleanupRetryAttempts=0,
        pendingCleanupRetryCapWarned=False,
    )
    EnvironmentLease.objects.filter(pk=lease.pk).update(
        status=EnvironmentLease.Status.PENDING_CLEANUP,
        cleanup_status=EnvironmentLease.CleanupStatus.FAILED,
        failure_reason=EXPORT_STOP_PENDING,
        released_at=Now(),
        updated_at=Now(),
        metadata=metadata,
    )
    activity_record(
        company_id=run.company_id,
        actor_type=actor_type,
        actor_id=actor_id,
        action="environment_lease.export_resume_preserved",
        entity_type="environment_lease",
        entity_id=lease.pk,
        run_id=run.pk,
        details={"requestId": request_id, "resultId": str(result_id)},
    )
    lease.refresh_from_db()
    return ExportResumePreserved(lease=lease, request_id=request_id)
