"""`export_resume_release_completed`: remove an active lease's export-resume marker once its
run's copy-back is verified and committed, so the original destroy policy applies again."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from uuid import UUID

from django.db import transaction
from django.db.models.functions import Now

from leases.environment.export_resume.binding import lease_metadata
from leases.environment.export_resume.keys import (
    EXPORT_RESUME_KEY,
    SYSTEM_ACTOR_ID,
    SYSTEM_ACTOR_TYPE,
)
from leases.environment.export_resume.markers import export_resume_read
from leases.environment.export_resume.sync_reference import read_native_workspace_sync_reference
from leases.environment.locks import environment_leases_for_update
from leases.models import EnvironmentLease
from paperclip.activity import activity_record
from paperclip.models import HeartbeatRun, NativeRunFinalization

ReleaseReason = Literal[
    "released",
    "lease_missing",
    "marker_invalid",
    "run_not_terminal",
    "run_not_committed",
    "result_mismatch",
    "copy_back_unverified",
    "allocation_mismatch",
    "competing_owner",
    "lease_not_active",
]


@dataclass(frozen=True, slots=True)
class ExportResumeRelease:
    """`released` is True only when the marker was removed; `reason` says why not."""

    released: bool
    reason: ReleaseReason
    lease: EnvironmentLease | None


def export_resume_release_completed(
    *,
    lease_id: UUID,
    actor_type: str = SYSTEM_ACTOR_TYPE,
    actor_id: str = SYSTEM_ACTOR_ID,
) -> ExportResumeRelease:
    """Remove the export-resume marker of an active lease after exact, committed copy-back.

    Only verified copy-back plus commitment permits the original destroy policy again; a
    terminal failure or a merely accepted result is not enough. Requires: a readable marker;
    the run terminal with `native_phase='committed'`; its coordinator `committed` with the
    marker's result; the run's sync reference `finalized` with a final host digest,
    disposition `destroy` and this exact lease and allocation; no *other* lease (any company:
    the allocation is physical) of the same provider allocation `active`, `retained` or
    `pending_cleanup`; and the lease still `active` with the same run, allocation, plugin pin
    and marker request id (guarded under the row lock). Writes one audit row when released.

    Locks: the lease row FOR NO KEY UPDATE.
    """
    with transaction.atomic():  # composable into a caller's transaction
        lease = environment_leases_for_update().filter(pk=lease_id).first()
        if lease is None:
            return ExportResumeRelease(False, "lease_missing", None)
        marker = export_resume_read(lease)
        if marker is None or lease.heartbeat_run_id is None:  # a readable marker has a run
            return ExportResumeRelease(False, "marker_invalid", lease)
        run = HeartbeatRun.objects.filter(
            pk=lease.heartbeat_run_id, company_id=lease.company_id
        ).first()
        if run is None or run.status not in HeartbeatRun.TERMINAL_STATUSES:
            return ExportResumeRelease(False, "run_not_terminal", lease)
        coordinator = NativeRunFinalization.objects.filter(
            run_id=run.pk, company_id=run.company_id
        ).first()
        if (
            run.native_phase != NativeRunFinalization.Phase.COMMITTED
            or coordinator is None
            or coordinator.phase != NativeRunFinalization.Phase.COMMITTED
        ):
            return ExportResumeRelease(False, "run_not_committed", lease)
        if str(coordinator.result_id) != marker.result_id:
            return ExportResumeRelease(False, "result_mismatch", lease)
        profile = run.runner_profile_json if isinstance(run.runner_profile_json, dict) else {}
        reference = read_native_workspace_sync_reference(profile.get("nativeWorkspaceSync"))
        if (
            reference is None
            or reference.state != "finalized"
            or not reference.final_host_sha256
            or reference.resource_disposition != "destroy"
        ):
            return ExportResumeRelease(False, "copy_back_unverified", lease)
        if (
            reference.lease_id != str(lease.pk)
            or reference.provider_lease_id != lease.provider_lease_id
        ):
            return ExportResumeRelease(False, "allocation_mismatch", lease)
        competing = (
            EnvironmentLease.objects.exclude(pk=lease.pk)
            .filter(
                provider=lease.provider,
                provider_lease_id=lease.provider_lease_id,
                status__in=EnvironmentLease.LIVE_ALLOCATION_STATUSES,
            )
            .exists()
        )
        if competing:
            return ExportResumeRelease(False, "competing_owner", lease)
        if lease.status != EnvironmentLease.Status.ACTIVE:
            return ExportResumeRelease(False, "lease_not_active", lease)
        metadata = {k: v for k, v in lease_metadata(lease).items() if k != EXPORT_RESUME_KEY}
        EnvironmentLease.objects.filter(pk=lease.pk).update(metadata=metadata, updated_at=Now())
        activity_record(
            company_id=lease.company_id,
            actor_type=actor_type,
            actor_id=actor_id,
            action="environment_lease.export_resume_released",
            entity_type="environment_lease",
            entity_id=lease.pk,
            run_id=lease.heartbeat_run_id,
            details={"requestId": marker.request_id, "resultId": marker.result_id},
        )
        lease.refresh_from_db()
        return ExportResumeRelease(True, "released", lease)
