"""Export-resume retention markers on environment leases
(docs/environment.md#export-resume-markers).

A lease whose run has an accepted result but unexported work carries a stop-only intent
(`metadata.nativeWorkspaceExportResume`): cleanup may *stop* that exact allocation, never
destroy it, until verified copy-back and commitment release the marker. The readers here are
strict: any field that does not bind to the row makes the marker unreadable, and an unreadable
marker never degrades into ordinary (destructive) cleanup.

JSON keys inside `metadata` are camelCase (docs/data-model.md#naming-conventions).

Transactions: `export_resume_preserve` runs inside the finalizer's transaction (it must commit
together with the terminal failure it protects). `export_resume_release_completed` and
`export_resume_settle` open a plain `atomic()` (a savepoint when nested) rather than a durable
one, because they are composed into a caller's transaction as well as called alone.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, Literal
from uuid import UUID

from django.conf import settings
from django.db import transaction
from django.db.models.functions import Now

from leases.environment.locks import environment_leases_for_update
from leases.models import EnvironmentLease
from paperclip.activity import activity_record
from paperclip.db.clock import db_now
from paperclip.db.locking import require_transaction
from paperclip.ids import parse_uuid
from paperclip.models import HeartbeatRun, NativeRunFinalization, NativeRunResult

EXPORT_RESUME_KEY: Final = "nativeWorkspaceExportResume"
EXPORT_RESUME_V1: Final = "paperclip.workspace-export-resume.v1"
EXPORT_RESUME_V2: Final = "paperclip.workspace-export-resume.v2"
EXPORT_RESUME_SCHEMAS: Final = frozenset({EXPORT_RESUME_V1, EXPORT_RESUME_V2})
STOP_AND_RETAIN_KEY: Final = "sandboxStopAndRetain"
# The metadata keys that carry a stop-only intent, and the columns `stop_only_cleanup_problem`
# reads: a query that judges many leases loads only these.
STOP_ONLY_KEYS: Final = (EXPORT_RESUME_KEY, STOP_AND_RETAIN_KEY)
STOP_ONLY_READ_FIELDS: Final = (
    "id",
    "company_id",
    "heartbeat_run_id",
    "provider",
    "provider_lease_id",
    "metadata",
)
STOP_AND_RETAIN_SCHEMA: Final = "paperclip.sandbox-stop-and-retain.v1"
REMOTE_TERMINATION_KEY: Final = "remoteExecutionTermination"
REMOTE_TERMINATION_SCHEMA: Final = "paperclip.remote-termination.v1"
SYNC_REFERENCE_SCHEMA: Final = "paperclip.native-workspace-sync/v1"
EXPORT_STOP_PENDING: Final = "workspace_export_stop_pending"


SYSTEM_ACTOR_TYPE: Final = "system"
SYSTEM_ACTOR_ID: Final = "paperclip"

_HEX64 = re.compile(r"[0-9a-f]{64}")
_RESOURCE_DISPOSITIONS = frozenset({"keep_running", "stop_and_retain", "destroy"})


# --- Parsers ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NativeWorkspaceSyncReference:
    """`runner_profile_json.nativeWorkspaceSync`, validated
    (docs/environment.md#native-workspace-sync-reference)."""

    state: Literal["prepared", "finalized"]
    descriptor_sha256: str
    baseline_sha256: str
    final_host_sha256: str | None
    workspace_id: str
    lease_id: str
    provider_lease_id: str
    remote_cwd: str
    resource_disposition: str | None

    def as_json(self) -> dict[str, Any]:
        """The normalized reference in its stored (camelCase) form."""
        return {
            "schema": SYNC_REFERENCE_SCHEMA,
            "state": self.state,
            "descriptorSha256": self.descriptor_sha256,
            "baselineSha256": self.baseline_sha256,
            "finalHostSha256": self.final_host_sha256,
            "workspaceId": self.workspace_id,
            "leaseId": self.lease_id,
            "providerLeaseId": self.provider_lease_id,
            "remoteCwd": self.remote_cwd,
            "resourceDisposition": self.resource_disposition,
        }


def _is_hex64(value: object) -> bool:
    return isinstance(value, str) and _HEX64.fullmatch(value) is not None


def read_native_workspace_sync_reference(value: object) -> NativeWorkspaceSyncReference | None:
    """Strictly parse a native workspace sync reference; None on any deviation.

    `finalHostSha256` and `resourceDisposition` may be null; an absent key counts as null.
    """
    if not isinstance(value, Mapping) or value.get("schema") != SYNC_REFERENCE_SCHEMA:
        return None
    state = value.get("state")
    final_host = value.get("finalHostSha256")
    disposition = value.get("resourceDisposition")
    strings = [value.get(k) for k in ("workspaceId", "leaseId", "providerLeaseId", "remoteCwd")]
    if (
        state not in ("prepared", "finalized")
        or not _is_hex64(value.get("descriptorSha256"))
        or not _is_hex64(value.get("baselineSha256"))
        or (final_host is not None and not _is_hex64(final_host))
        or any(not isinstance(s, str) for s in strings)
        or (disposition is not None and disposition not in _RESOURCE_DISPOSITIONS)
    ):
        return None
    workspace_id, lease_id, provider_lease_id, remote_cwd = (str(s) for s in strings)
    return NativeWorkspaceSyncReference(
        state=state,
        descriptor_sha256=str(value["descriptorSha256"]),
        baseline_sha256=str(value["baselineSha256"]),
        final_host_sha256=final_host,
        workspace_id=workspace_id,
        lease_id=lease_id,
        provider_lease_id=provider_lease_id,
        remote_cwd=remote_cwd,
        resource_disposition=disposition,
    )


def _metadata(lease: EnvironmentLease) -> dict[str, Any]:
    return lease.metadata if isinstance(lease.metadata, dict) else {}


def _nonempty_str(value: object) -> bool:
    return isinstance(value, str) and value != ""


def _binding_problem(intent: Mapping[str, Any], lease: EnvironmentLease) -> str | None:
    """Which binding check fails first (company, run, lease, provider, allocation), or None."""
    if lease.heartbeat_run_id is None:
        return "the lease has no run"
    if not _nonempty_str(lease.provider):
        return "the lease has no provider"
    if not _nonempty_str(lease.provider_lease_id):
        return "the lease has no provider allocation id"
    for key, expected in (
        ("companyId", str(lease.company_id)),
        ("runId", str(lease.heartbeat_run_id)),
        ("leaseId", str(lease.id)),
        ("provider", lease.provider),
        ("providerLeaseId", lease.provider_lease_id),
    ):
        if intent.get(key) != expected:
            return f"{key} does not equal the lease's ({intent.get(key)!r} != {expected!r})"
    return None


def _binds_to_lease(intent: Mapping[str, Any], lease: EnvironmentLease) -> bool:
    """Company, run, lease, provider and allocation of an intent all equal the row's."""
    return _binding_problem(intent, lease) is None


@dataclass(frozen=True, slots=True)
class ExportResumeMarker:
    """A validated export-resume marker, with its normalized request, result and plugin pin."""

    schema: str
    request_id: str
    result_id: str
    plugin_id: str
    purpose: str | None
    raw: Mapping[str, Any]


def export_resume_has(lease: EnvironmentLease) -> bool:
    """True when the lease metadata has the marker key at all, whatever its validity."""
    return EXPORT_RESUME_KEY in _metadata(lease)


def export_resume_read(lease: EnvironmentLease) -> ExportResumeMarker | None:
    """The lease's export-resume marker if every binding field equals the row; else None.

    Rules: schema v1 or v2; company, run, lease, provider and provider allocation equal the
    row's (which must have a run, a provider and an allocation); non-empty `requestId` and
    `resultId`; plugin pin: a v1 marker *without* a `pluginId` key falls back to the lease's
    `metadata.pluginId` (v1 predates the explicit pin), otherwise the marker's own `pluginId`
    is used even when invalid (an explicit pin is never overridden); the pin must be a
    non-empty string equal to `metadata.pluginId`. `export_resume_problem` names the failed
    rule: both read the same checks.
    """
    return _export_resume_check(lease)[0]


def export_resume_problem(lease: EnvironmentLease) -> str | None:
    """Why the lease's export-resume marker is unreadable, in words (the first failed check),
    or None when it is absent or valid."""
    if not export_resume_has(lease):
        return None
    return _export_resume_check(lease)[1]


def _export_resume_check(lease: EnvironmentLease) -> tuple[ExportResumeMarker | None, str | None]:
    metadata = _metadata(lease)
    marker = metadata.get(EXPORT_RESUME_KEY)
    if not isinstance(marker, dict):
        return None, "the marker is not a JSON object"
    schema = marker.get("schema")
    request_id = marker.get("requestId")
    result_id = marker.get("resultId")
    if schema not in EXPORT_RESUME_SCHEMAS:
        return None, f"unknown schema {schema!r}"
    if problem := _binding_problem(marker, lease):
        return None, problem
    if not isinstance(request_id, str) or not request_id:
        return None, "requestId is missing or empty"
    if not isinstance(result_id, str) or not result_id:
        return None, "resultId is missing or empty"
    lease_plugin = metadata.get("pluginId")
    pin = (
        lease_plugin
        if schema == EXPORT_RESUME_V1 and "pluginId" not in marker
        else marker.get("pluginId")
    )
    if not isinstance(pin, str) or not pin:
        return None, "the plugin pin (pluginId) is missing or empty"
    if pin != lease_plugin:
        return None, f"the plugin pin {pin!r} does not equal the lease's pluginId {lease_plugin!r}"
    purpose = marker.get("purpose")
    return (
        ExportResumeMarker(
            schema=str(schema),
            request_id=request_id,
            result_id=result_id,
            plugin_id=pin,
            purpose=purpose if isinstance(purpose, str) else None,
            raw=marker,
        ),
        None,
    )


@dataclass(frozen=True, slots=True)
class StopOnlyIntent:
    """A validated stop-only cleanup intent (docs/environment.md#stop-only-cleanup-intent): stop the
    allocation, never destroy it."""

    kind: Literal["export_resume", "sandbox_stop_and_retain"]
    request_id: str
    plugin_id: str | None
    builtin_provider: str | None


def stop_only_cleanup_has(lease: EnvironmentLease) -> bool:
    """True when either stop-only intent key is present, valid or not."""
    metadata = _metadata(lease)
    return EXPORT_RESUME_KEY in metadata or STOP_AND_RETAIN_KEY in metadata


def stop_only_cleanup_read(lease: EnvironmentLease) -> StopOnlyIntent | None:
    """The lease's stop-only intent, or None when it is absent or does not bind to the row.

    An export-resume marker, when present, decides alone (even when invalid). Otherwise the
    generic `sandboxStopAndRetain` intent must carry its schema, bind to company, run, lease,
    provider and allocation, have a non-empty `requestId`, and name exactly one owner: a
    built-in provider equal to `lease.provider` (no plugin pins anywhere), or a `pluginId`
    equal to the lease's `metadata.pluginId`. `stop_only_cleanup_problem` names the failed
    rule: both read the same checks.
    """
    return _stop_only_check(lease)[0]


def stop_only_cleanup_problem(lease: EnvironmentLease) -> str | None:
    """Why a present stop-only intent is invalid, in words (`<key>: <first failed check>`), or
    None when there is none or it is valid. Such a lease is never cleaned up automatically."""
    if not stop_only_cleanup_has(lease):
        return None
    return _stop_only_check(lease)[1]


def _stop_only_check(lease: EnvironmentLease) -> tuple[StopOnlyIntent | None, str | None]:
    if export_resume_has(lease):
        marker, problem = _export_resume_check(lease)
        if marker is None:
            return None, f"{EXPORT_RESUME_KEY}: {problem}"
        return StopOnlyIntent("export_resume", marker.request_id, marker.plugin_id, None), None
    metadata = _metadata(lease)
    if STOP_AND_RETAIN_KEY not in metadata:
        return None, None
    intent = metadata.get(STOP_AND_RETAIN_KEY)

    def bad(why: str) -> tuple[None, str]:
        return None, f"{STOP_AND_RETAIN_KEY}: {why}"

    if not isinstance(intent, dict):
        return bad("the intent is not a JSON object")
    if intent.get("schema") != STOP_AND_RETAIN_SCHEMA:
        return bad(f"unknown schema {intent.get('schema')!r}")
    if problem := _binding_problem(intent, lease):
        return bad(problem)
    if not _nonempty_str(intent.get("requestId")):
        return bad("requestId is missing or empty")
    builtin, plugin = intent.get("builtinProvider"), intent.get("pluginId")
    lease_plugin = metadata.get("pluginId")
    if builtin is not None and "pluginId" not in intent and lease_plugin is None:
        if builtin != lease.provider:
            return bad(f"builtinProvider {builtin!r} is not the lease's provider")
        return StopOnlyIntent("sandbox_stop_and_retain", intent["requestId"], None, builtin), None
    if "builtinProvider" in intent:
        return bad("names both a built-in provider and a plugin (or a plugin pin exists)")
    if not _nonempty_str(plugin):
        return bad("names no owner (builtinProvider or pluginId)")
    if plugin != lease_plugin:
        return bad(f"pluginId {plugin!r} does not equal the lease's pluginId {lease_plugin!r}")
    return StopOnlyIntent("sandbox_stop_and_retain", intent["requestId"], plugin, None), None


def remote_termination_receipt(
    lease: EnvironmentLease, value: object, *, confirmed_at: datetime
) -> dict[str, Any] | None:
    """Bind a provider's stop/destroy reply to this exact lease
    (docs/environment.md#provider-reply-binding).

    None unless the lease has a run, a non-local provider and an allocation, the reply names
    that allocation, and its state is `stopped` or `destroyed`.
    """
    if (
        not isinstance(value, Mapping)
        or lease.heartbeat_run_id is None
        or not _nonempty_str(lease.provider)
        or lease.provider == "local"
        or not _nonempty_str(lease.provider_lease_id)
        or value.get("providerLeaseId") != lease.provider_lease_id
        or value.get("state") not in ("stopped", "destroyed")
    ):
        return None
    return {
        "schema": REMOTE_TERMINATION_SCHEMA,
        "companyId": str(lease.company_id),
        "runId": str(lease.heartbeat_run_id),
        "leaseId": str(lease.id),
        "provider": lease.provider,
        "providerLeaseId": lease.provider_lease_id,
        "state": value["state"],
        "confirmedAt": confirmed_at.isoformat(),
    }


def remote_termination_has(lease: EnvironmentLease) -> bool:
    """True only for a retired, successfully cleaned lease whose stored termination receipt
    still binds to it."""
    receipt = _metadata(lease).get(REMOTE_TERMINATION_KEY)
    if (
        lease.released_at is None
        or lease.cleanup_status != EnvironmentLease.CleanupStatus.SUCCESS
        or lease.status not in EnvironmentLease.RETIRED_STATUSES
        or not isinstance(receipt, dict)
        or receipt.get("schema") != REMOTE_TERMINATION_SCHEMA
        or not isinstance(receipt.get("confirmedAt"), str)
    ):
        return False
    rebound = remote_termination_receipt(
        lease, receipt, confirmed_at=datetime.fromisoformat("1970-01-01T00:00:00+00:00")
    )
    return rebound is not None and all(
        rebound[k] == receipt.get(k) for k in ("companyId", "runId", "leaseId", "provider")
    )


# --- Services -----------------------------------------------------------------------------


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
    metadata = {k: v for k, v in _metadata(lease).items() if k != REMOTE_TERMINATION_KEY}
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
        metadata = {k: v for k, v in _metadata(lease).items() if k != EXPORT_RESUME_KEY}
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


def export_resume_settle(
    *,
    lease: EnvironmentLease,
    attempt_id: str,
    receipt: Mapping[str, Any] | None = None,
    status: Literal["released", "expired"] = "released",
    actor_type: str = SYSTEM_ACTOR_TYPE,
    actor_id: str = SYSTEM_ACTOR_ID,
) -> EnvironmentLease | None:
    """Apply a provider's stop reply (`receipt`: `{providerLeaseId, state}`) to a
    pending-cleanup export lease, as read earlier into `lease`.

    A `stopped` reply bound to this exact lease settles it: `status` (released or expired),
    cleanup `success`, marker removed, the termination receipt stored. Anything else keeps it
    `pending_cleanup` with cleanup `failed` and the marker kept. Always: `released_at`,
    `last_used_at` now, not in flight, claim expiry 0, any older receipt removed.

    Guard (re-checked on the locked row against the `lease` snapshot): same id, company, run,
    provider and allocation, still `pending_cleanup`, `pendingCleanupAttemptId == attempt_id`,
    the same marker request id and plugin pin. So a late receipt can never rewrite a rebound
    lease or a newer attempt. Returns the settled row, or None when the guard failed.
    Writes one audit row when it changes the lease. Locks: the lease row FOR NO KEY UPDATE.
    """
    marker = export_resume_read(lease)
    if marker is None:
        return None
    with transaction.atomic():  # composable into a caller's transaction
        current = (
            environment_leases_for_update()
            .filter(
                pk=lease.pk,
                company_id=lease.company_id,
                heartbeat_run_id=lease.heartbeat_run_id,
                provider=lease.provider,
                provider_lease_id=lease.provider_lease_id,
                status=EnvironmentLease.Status.PENDING_CLEANUP,
            )
            .first()
        )
        current_meta = _metadata(current) if current is not None else {}
        current_marker = current_meta.get(EXPORT_RESUME_KEY)
        if (
            current is None
            or current_meta.get("pendingCleanupAttemptId") != attempt_id
            or not isinstance(current_marker, dict)
            or current_marker.get("requestId") != marker.request_id
            or current_meta.get("pluginId") != marker.plugin_id
        ):
            return None
        bound = remote_termination_receipt(current, receipt, confirmed_at=db_now())
        stopped = bound is not None and bound["state"] == "stopped"
        dropped = (
            {REMOTE_TERMINATION_KEY, EXPORT_RESUME_KEY} if stopped else {REMOTE_TERMINATION_KEY}
        )
        metadata = {k: v for k, v in current_meta.items() if k not in dropped}
        if stopped:
            metadata[REMOTE_TERMINATION_KEY] = bound
        return cleanup_settle_write_in_tx(
            current,
            metadata=metadata,
            settles=stopped,
            settled_status=status,
            actor_type=actor_type,
            actor_id=actor_id,
            attempt_id=attempt_id,
            intent="export_resume",
            receipt_state=receipt.get("state") if isinstance(receipt, Mapping) else None,
            extra={"requestId": marker.request_id},
        )


def cleanup_retry_after_ms(attempts: int) -> int:
    """When a cleanup that failed `attempts` times may be claimed again (epoch ms, database
    clock): PAPERCLIP_CLEANUP_RETRY_BASE_SECONDS doubling per attempt, capped at
    PAPERCLIP_CLEANUP_RETRY_CAP_SECONDS."""
    base = settings.PAPERCLIP_CLEANUP_RETRY_BASE_SECONDS
    delay = min(base * 2 ** max(attempts - 1, 0), settings.PAPERCLIP_CLEANUP_RETRY_CAP_SECONDS)
    return int(db_now().timestamp() * 1000) + int(delay * 1000)


def cleanup_settle_write_in_tx(
    lease: EnvironmentLease,
    *,
    metadata: dict[str, Any],
    settles: bool,
    settled_status: str,
    actor_type: str,
    actor_id: str,
    attempt_id: str,
    intent: str | None,
    receipt_state: object,
    extra: dict[str, Any] | None = None,
) -> EnvironmentLease:
    """Write a provider reply's outcome onto the locked lease, the one way both settle paths
    (export-resume and the plain cleanup protocol) do it: `settled_status` with cleanup
    success when the reply settles, otherwise `pending_cleanup` with cleanup failed; the claim
    is cleared either way, so the next claim retries. `metadata` is the lease's new metadata.
    One audit row (`environment_lease.cleanup_settled`); returns the lease re-read."""
    require_transaction()
    metadata.update(pendingCleanupInFlight=False, pendingCleanupLeaseExpiresAtMs=0)
    retry: dict[str, int] = {}
    if not settles:
        # A reply that does not settle is a failed attempt: the next claim waits out a
        # back-off on the database clock (docs/environment.md#cleanup-retries).
        attempts = metadata.get("pendingCleanupRetryAttempts")
        attempts = (attempts if isinstance(attempts, int) and attempts >= 0 else 0) + 1
        retry_after_ms = cleanup_retry_after_ms(attempts)
        metadata.update(
            pendingCleanupRetryAttempts=attempts, pendingCleanupRetryAfterMs=retry_after_ms
        )
        retry = {"retryAttempts": attempts, "retryAfterMs": retry_after_ms}
    new_status = settled_status if settles else EnvironmentLease.Status.PENDING_CLEANUP
    cleanup = (
        EnvironmentLease.CleanupStatus.SUCCESS if settles else EnvironmentLease.CleanupStatus.FAILED
    )
    EnvironmentLease.objects.filter(pk=lease.pk).update(
        status=new_status,
        cleanup_status=cleanup,
        released_at=Now(),
        last_used_at=Now(),
        updated_at=Now(),
        metadata=metadata,
    )
    activity_record(
        company_id=lease.company_id,
        actor_type=actor_type,
        actor_id=actor_id,
        action="environment_lease.cleanup_settled",
        entity_type="environment_lease",
        entity_id=lease.pk,
        run_id=lease.heartbeat_run_id,
        details={
            "attemptId": attempt_id,
            "intent": intent,
            **(extra or {}),
            **retry,
            "receiptState": receipt_state,
            "stopped": settles,
            "status": new_status,
        },
    )
    lease.refresh_from_db()
    return lease
