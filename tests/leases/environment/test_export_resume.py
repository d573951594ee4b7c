"""Export-resume markers: parsers, marker rules, preserve, release-completed, settle guards."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest

from leases.environment.export_resume.markers import (
    export_resume_has,
    export_resume_read,
    stop_only_cleanup_read,
)
from leases.environment.export_resume.preserve import export_resume_preserve
from leases.environment.export_resume.release import export_resume_release_completed
from leases.environment.export_resume.settle import export_resume_settle
from leases.environment.export_resume.sync_reference import read_native_workspace_sync_reference
from leases.environment.export_resume.termination import (
    remote_termination_has,
    remote_termination_receipt,
)
from leases.models import EnvironmentLease
from paperclip.models import ActivityEvent, HeartbeatRun
from tests.leases.environment.factories import (
    HEX_A,
    HEX_B,
    HEX_C,
    PLUGIN,
    EnvironmentLeaseFactory,
    export_marker,
    set_meta,
    sync_reference,
)
from tests.paperclip.factories import (
    CompanyFactory,
    ExecutionWorkspaceFactory,
    NativeRunFactory,
    NativeRunFinalizationFactory,
    NativeRunResultFactory,
)

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def unsaved_lease(**fields: Any) -> EnvironmentLease:
    values: dict[str, Any] = {
        "id": uuid.uuid4(),
        "company_id": uuid.uuid4(),
        "heartbeat_run_id": uuid.uuid4(),
        "provider": "daytona",
        "provider_lease_id": "sbx-1",
        "metadata": {"pluginId": PLUGIN},
    }
    values.update(fields)
    return EnvironmentLease(**values)


def with_marker(lease: EnvironmentLease, **changes: Any) -> EnvironmentLease:
    marker = export_marker(lease, **changes)
    for key in [k for k, v in changes.items() if v is ...]:
        del marker[key]
    lease.metadata = {**(lease.metadata or {}), "nativeWorkspaceExportResume": marker}
    return lease


# --- Sync reference parser (§2.9) ----------------------------------------------------------


def _reference(**changes: Any) -> dict[str, Any]:
    value = {
        "schema": "paperclip.native-workspace-sync/v1",
        "state": "finalized",
        "descriptorSha256": HEX_A,
        "baselineSha256": HEX_B,
        "finalHostSha256": HEX_C,
        "workspaceId": "ws",
        "leaseId": "lease",
        "providerLeaseId": "sbx",
        "remoteCwd": "/w",
        "resourceDisposition": "destroy",
    }
    value.update(changes)
    return {k: v for k, v in value.items() if v is not ...}


@pytest.mark.parametrize(
    ("value", "valid"),
    [
        pytest.param(_reference(), True, id="valid-finalized"),
        pytest.param(
            _reference(state="prepared", finalHostSha256=None, resourceDisposition=None),
            True,
            id="valid-prepared-nulls",
        ),
        pytest.param(
            _reference(finalHostSha256=..., resourceDisposition=...), True, id="absent-nullables"
        ),
        pytest.param(_reference(schema="paperclip.native-workspace-sync/v2"), False, id="schema"),
        pytest.param(_reference(state="saved"), False, id="state"),
        pytest.param(_reference(descriptorSha256="A" * 64), False, id="uppercase-hex"),
        pytest.param(_reference(baselineSha256="b" * 63), False, id="short-hex"),
        pytest.param(_reference(finalHostSha256="zz"), False, id="final-host-hex"),
        pytest.param(_reference(leaseId=7), False, id="lease-not-string"),
        pytest.param(_reference(remoteCwd=None), False, id="cwd-null"),
        pytest.param(_reference(resourceDisposition="delete"), False, id="disposition"),
        pytest.param(["not", "a", "dict"], False, id="not-object"),
        pytest.param(None, False, id="null"),
    ],
)
def test_sync_reference_parser(value: Any, valid: bool) -> None:
    assert (read_native_workspace_sync_reference(value) is not None) is valid


# --- Marker rules (§3.3) ---------------------------------------------------------------------


MARKER_CASES: list[Any] = [
    pytest.param(lambda lease: with_marker(lease), True, id="v2-valid"),
    pytest.param(
        lambda lease: with_marker(
            lease, schema="paperclip.workspace-export-resume.v1", pluginId=...
        ),
        True,
        id="v1-without-pin-falls-back-to-lease-plugin",
    ),
    pytest.param(
        lambda lease: with_marker(
            lease, schema="paperclip.workspace-export-resume.v1", pluginId=None
        ),
        False,
        id="v1-explicit-null-pin-never-overridden",
    ),
    pytest.param(
        lambda lease: with_marker(
            lease, schema="paperclip.workspace-export-resume.v1", pluginId="other"
        ),
        False,
        id="v1-explicit-foreign-pin-never-overridden",
    ),
    pytest.param(
        lambda lease: with_marker(
            lease, schema="paperclip.workspace-export-resume.v1", pluginId=PLUGIN
        ),
        True,
        id="v1-explicit-matching-pin",
    ),
    pytest.param(
        lambda lease: with_marker(
            unsaved_lease(metadata={}), schema="paperclip.workspace-export-resume.v1", pluginId=...
        ),
        False,
        id="v1-without-pin-on-a-lease-without-plugin",
    ),
    pytest.param(
        lambda lease: with_marker(unsaved_lease(metadata={"pluginId": ""}), pluginId=""),
        False,
        id="empty-pin-equal-to-empty-lease-plugin",
    ),
    pytest.param(lambda lease: with_marker(lease, pluginId=...), False, id="v2-requires-pin"),
    pytest.param(lambda lease: with_marker(lease, pluginId="other"), False, id="pin-mismatch"),
    pytest.param(
        lambda lease: with_marker(unsaved_lease(metadata={}), pluginId=PLUGIN),
        False,
        id="lease-has-no-plugin",
    ),
    pytest.param(lambda lease: with_marker(lease, schema="v3"), False, id="schema"),
    pytest.param(
        lambda lease: with_marker(lease, companyId=str(uuid.uuid4())), False, id="company"
    ),
    pytest.param(lambda lease: with_marker(lease, runId=str(uuid.uuid4())), False, id="run"),
    pytest.param(lambda lease: with_marker(lease, leaseId=str(uuid.uuid4())), False, id="lease"),
    pytest.param(lambda lease: with_marker(lease, provider="e2b"), False, id="provider"),
    pytest.param(lambda lease: with_marker(lease, providerLeaseId="sbx-2"), False, id="allocation"),
    pytest.param(lambda lease: with_marker(lease, requestId=""), False, id="empty-request"),
    pytest.param(lambda lease: with_marker(lease, resultId=5), False, id="result-not-string"),
    pytest.param(
        lambda lease: with_marker(unsaved_lease(heartbeat_run_id=None), runId=None),
        False,
        id="lease-without-run",
    ),
    pytest.param(
        lambda lease: with_marker(unsaved_lease(provider=None), provider=None),
        False,
        id="lease-without-provider",
    ),
    pytest.param(
        lambda lease: with_marker(unsaved_lease(provider_lease_id=None), providerLeaseId=None),
        False,
        id="lease-without-allocation",
    ),
]


@pytest.mark.parametrize(("build", "valid"), MARKER_CASES)
def test_export_resume_read_rules(
    build: Callable[[EnvironmentLease], EnvironmentLease], valid: bool
) -> None:
    lease = build(unsaved_lease())
    marker = export_resume_read(lease)
    assert export_resume_has(lease)
    assert (marker is not None) is valid
    if marker is not None:
        assert marker.plugin_id == PLUGIN


def test_has_is_about_presence_not_validity() -> None:
    lease = unsaved_lease()
    assert not export_resume_has(lease)
    lease.metadata = {"nativeWorkspaceExportResume": "garbage"}
    assert export_resume_has(lease)
    assert export_resume_read(lease) is None


# --- Stop-only intents (§2.8) and termination receipts (§2.7) --------------------------------


def _stop_intent(lease: EnvironmentLease, **changes: Any) -> EnvironmentLease:
    intent = {
        "schema": "paperclip.sandbox-stop-and-retain.v1",
        "requestId": "req-1",
        "companyId": str(lease.company_id),
        "runId": str(lease.heartbeat_run_id),
        "leaseId": str(lease.pk),
        "provider": lease.provider,
        "providerLeaseId": lease.provider_lease_id,
        "pluginId": PLUGIN,
    }
    intent.update(changes)
    intent = {k: v for k, v in intent.items() if v is not ...}
    lease.metadata = {**(lease.metadata or {}), "sandboxStopAndRetain": intent}
    return lease


@pytest.mark.parametrize(
    ("build", "kind"),
    [
        pytest.param(lambda lease: with_marker(lease), "export_resume", id="export-marker"),
        pytest.param(lambda lease: with_marker(lease, leaseId="x"), None, id="invalid-export-wins"),
        pytest.param(lambda lease: _stop_intent(lease), "sandbox_stop_and_retain", id="plugin"),
        pytest.param(
            lambda lease: _stop_intent(
                unsaved_lease(metadata={}), pluginId=..., builtinProvider="daytona"
            ),
            "sandbox_stop_and_retain",
            id="builtin",
        ),
        pytest.param(
            lambda lease: _stop_intent(
                unsaved_lease(metadata={}), pluginId=..., builtinProvider="e2b"
            ),
            None,
            id="builtin-other-provider",
        ),
        pytest.param(
            lambda lease: _stop_intent(lease, pluginId=..., builtinProvider="daytona"),
            None,
            id="builtin-but-lease-plugin-pinned",
        ),
        pytest.param(
            lambda lease: _stop_intent(lease, pluginId="other"), None, id="plugin-mismatch"
        ),
        pytest.param(lambda lease: _stop_intent(lease, requestId=""), None, id="empty-request"),
        pytest.param(lambda lease: _stop_intent(lease, runId="x"), None, id="run-mismatch"),
        pytest.param(lambda lease: _stop_intent(lease, schema="v0"), None, id="schema"),
        pytest.param(lambda lease: lease, None, id="none"),
    ],
)
def test_stop_only_cleanup_read(
    build: Callable[[EnvironmentLease], EnvironmentLease], kind: str | None
) -> None:
    intent = stop_only_cleanup_read(build(unsaved_lease()))
    assert (intent.kind if intent else None) == kind


@pytest.mark.parametrize(
    ("lease_fields", "reply", "bound"),
    [
        pytest.param({}, {"providerLeaseId": "sbx-1", "state": "stopped"}, True, id="stopped"),
        pytest.param({}, {"providerLeaseId": "sbx-1", "state": "destroyed"}, True, id="destroyed"),
        pytest.param({}, {"providerLeaseId": "sbx-1", "state": "failed"}, False, id="failed"),
        pytest.param({}, {"providerLeaseId": "sbx-2", "state": "stopped"}, False, id="foreign"),
        pytest.param(
            {"provider": "local"},
            {"providerLeaseId": "sbx-1", "state": "stopped"},
            False,
            id="local",
        ),
        pytest.param(
            {"heartbeat_run_id": None},
            {"providerLeaseId": "sbx-1", "state": "stopped"},
            False,
            id="no-run",
        ),
        pytest.param({}, None, False, id="no-reply"),
    ],
)
def test_remote_termination_receipt_binding(
    lease_fields: dict[str, Any], reply: Any, bound: bool
) -> None:
    lease = unsaved_lease(**lease_fields)
    receipt = remote_termination_receipt(lease, reply, confirmed_at=NOW)
    assert (receipt is not None) is bound
    if receipt is not None:
        assert receipt["leaseId"] == str(lease.pk)
        assert receipt["schema"] == "paperclip.remote-termination.v1"
        lease.metadata = {"remoteExecutionTermination": receipt}
        lease.status, lease.cleanup_status, lease.released_at = "released", "success", NOW
        assert remote_termination_has(lease)
        lease.status = "pending_cleanup"
        assert not remote_termination_has(lease)


# --- preserve --------------------------------------------------------------------------------


def _export_run(*, state: str = "prepared", lease_status: str = "active") -> tuple[Any, Any, Any]:
    run = NativeRunFactory(status=HeartbeatRun.Status.RUNNING)
    workspace = ExecutionWorkspaceFactory(company=run.company)
    lease = EnvironmentLeaseFactory(
        company=run.company, heartbeat_run=run, issue=run.native_issue, status=lease_status
    )
    set_meta(
        lease,
        remoteExecutionTermination={"schema": "old"},
        # Leftovers of an earlier cleanup cycle: preserve must reset every one of them.
        pendingCleanupAttemptId="attempt-old",
        pendingCleanupInFlight=True,
        pendingCleanupLeaseExpiresAtMs=123,
        pendingCleanupRetryAfterMs=456,
        pendingCleanupRetryAttempts=4,
        pendingCleanupRetryCapWarned=True,
    )
    run.runner_profile_json = {
        "nativeWorkspaceSync": sync_reference(lease, workspace.pk, state=state)
    }
    run.save()
    result = NativeRunResultFactory(run=run)
    return run, lease, result


@pytest.mark.django_db
def test_preserve_tags_the_prepared_export_lease() -> None:
    run, lease, result = _export_run()
    preserved = export_resume_preserve(run_id=run.pk, result_id=result.pk)
    assert preserved is not None
    lease.refresh_from_db()
    assert (lease.status, lease.cleanup_status, lease.failure_reason) == (
        "pending_cleanup",
        "failed",
        "workspace_export_stop_pending",
    )
    assert lease.released_at is not None
    meta = lease.metadata
    assert "remoteExecutionTermination" not in meta
    marker = export_resume_read(lease)
    assert marker is not None
    assert (marker.schema, marker.result_id, marker.purpose) == (
        "paperclip.workspace-export-resume.v2",
        str(result.pk),
        "terminal_export",
    )
    assert meta["pendingCleanupAttemptId"] == marker.request_id == preserved.request_id
    assert {k: v for k, v in meta.items() if k.startswith("pendingCleanup")} == {
        "pendingCleanupAttemptId": preserved.request_id,
        "pendingCleanupInFlight": False,
        "pendingCleanupLeaseExpiresAtMs": 0,
        "pendingCleanupRetryAfterMs": 0,
        "pendingCleanupRetryAttempts": 0,
        "pendingCleanupRetryCapWarned": False,
    }
    assert (meta["pluginId"], meta["remoteCwd"]) == (PLUGIN, "/workspace")  # kept
    assert marker.raw["leaseId"] == str(lease.pk)
    assert marker.raw["providerLeaseId"] == lease.provider_lease_id
    assert (
        ActivityEvent.objects.filter(
            action="environment_lease.export_resume_preserved", entity_id=str(lease.pk)
        ).count()
        == 1
    )


def _reject_result(run: Any, lease: Any, result: Any) -> Any:
    result.schema_status = "rejected"
    result.save()
    return result.pk


def _other_contract(run: Any, lease: Any, result: Any) -> Any:
    result.completion_contract_id = uuid.uuid4()
    result.save()
    return result.pk


def _rebound_lease(run: Any, lease: Any, result: Any) -> Any:
    lease.heartbeat_run = NativeRunFactory(company=run.company)
    lease.save()
    return result.pk


def _reallocated_reference(run: Any, lease: Any, result: Any) -> Any:
    reference = {**run.runner_profile_json["nativeWorkspaceSync"], "providerLeaseId": "sbx-x"}
    run.runner_profile_json = {"nativeWorkspaceSync": reference}
    run.save()
    return result.pk


def _result_of_other_run(run: Any, lease: Any, result: Any) -> Any:
    other = NativeRunFactory(company=run.company, completion_contract_id=run.completion_contract_id)
    return NativeRunResultFactory(run=other).pk


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("state", "lease_status", "mutate"),
    [
        pytest.param("finalized", "active", None, id="reference-not-prepared"),
        pytest.param("prepared", "retained", None, id="lease-not-active"),
        pytest.param("prepared", "active", lambda *a: None, id="no-result"),
        pytest.param("prepared", "active", _reject_result, id="result-rejected"),
        pytest.param("prepared", "active", _other_contract, id="result-other-contract"),
        pytest.param("prepared", "active", _rebound_lease, id="lease-of-another-run"),
        pytest.param("prepared", "active", _reallocated_reference, id="reference-allocation"),
        pytest.param("prepared", "active", _result_of_other_run, id="result-of-another-run"),
    ],
)
def test_preserve_does_nothing_unless_every_condition_holds(
    state: str, lease_status: str, mutate: Callable[..., Any] | None
) -> None:
    run, lease, result = _export_run(state=state, lease_status=lease_status)
    result_id = mutate(run, lease, result) if mutate else result.pk
    assert export_resume_preserve(run_id=run.pk, result_id=result_id) is None
    lease.refresh_from_db()
    assert lease.status == lease_status
    assert not export_resume_has(lease)
    assert not ActivityEvent.objects.filter(entity_type="environment_lease").exists()


@pytest.mark.django_db(transaction=True)
def test_preserve_refuses_to_run_outside_the_finalizers_transaction() -> None:
    run, lease, result = _export_run()
    with pytest.raises(RuntimeError, match="must run inside the caller's transaction"):
        export_resume_preserve(run_id=run.pk, result_id=result.pk)
    assert EnvironmentLease.objects.get(pk=lease.pk).status == "active"


# --- release_completed: the nine cases ------------------------------------------------------


def _retained_export(case: str) -> EnvironmentLease:
    """An active lease with a marker; its run committed exact copy-back, except for `case`."""
    run_status = {"committed_failed": "failed", "committed_cancelled": "cancelled"}.get(
        case, "succeeded"
    )
    run = NativeRunFactory(status="running" if case == "running" else run_status)
    workspace = ExecutionWorkspaceFactory(company=run.company)
    lease = EnvironmentLeaseFactory(company=run.company, heartbeat_run=run, issue=run.native_issue)
    result = NativeRunResultFactory(run=run)
    marker = export_marker(lease, resultId=str(result.pk))
    set_meta(lease, nativeWorkspaceExportResume=marker)
    reference = sync_reference(lease, workspace.pk, state="finalized")
    if case == "unexported":
        reference = sync_reference(lease, workspace.pk, state="prepared")
    if case == "wrong_allocation":
        reference["providerLeaseId"] = "sbx-elsewhere"
    run.runner_profile_json = {"nativeWorkspaceSync": reference}
    run.native_phase = "workspace_finalizing" if case == "uncommitted_run" else "committed"
    run.save()
    other_result = NativeRunResultFactory(run=run) if case == "wrong_result" else result
    NativeRunFinalizationFactory(
        run=run,
        phase="terminal_failure" if case == "uncommitted_run" else "committed",
        result=other_result,
    )
    if case == "competing_owner":
        EnvironmentLeaseFactory(
            provider=lease.provider, provider_lease_id=lease.provider_lease_id, status="retained"
        )
    return lease


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("complete", "released"),
        ("committed_failed", "released"),
        ("committed_cancelled", "released"),
        ("running", "run_not_terminal"),
        ("unexported", "copy_back_unverified"),
        ("wrong_result", "result_mismatch"),
        ("uncommitted_run", "run_not_committed"),
        ("wrong_allocation", "allocation_mismatch"),
        ("competing_owner", "competing_owner"),
    ],
)
def test_release_completed(case: str, reason: str) -> None:
    lease = _retained_export(case)
    outcome = export_resume_release_completed(lease_id=lease.pk)
    assert (outcome.released, outcome.reason) == (reason == "released", reason)
    lease.refresh_from_db()
    assert export_resume_has(lease) is (reason != "released")
    audits = ActivityEvent.objects.filter(action="environment_lease.export_resume_released")
    assert audits.count() == (1 if reason == "released" else 0)


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("status", "blocks"),
    [
        ("active", True),
        ("retained", True),
        ("pending_cleanup", True),
        ("released", False),
        ("expired", False),
        ("failed", False),
    ],
)
def test_only_a_live_other_lease_of_the_allocation_competes(status: str, blocks: bool) -> None:
    lease = _retained_export("complete")
    EnvironmentLeaseFactory(
        provider=lease.provider, provider_lease_id=lease.provider_lease_id, status=status
    )
    # Another provider's allocation with the same id is a different allocation.
    EnvironmentLeaseFactory(provider="e2b", provider_lease_id=lease.provider_lease_id)
    outcome = export_resume_release_completed(lease_id=lease.pk)
    assert outcome.released is not blocks
    assert outcome.reason == ("competing_owner" if blocks else "released")


@pytest.mark.django_db
def test_release_completed_needs_an_active_lease_and_a_readable_marker() -> None:
    lease = _retained_export("complete")
    EnvironmentLease.objects.filter(pk=lease.pk).update(status="pending_cleanup")
    assert export_resume_release_completed(lease_id=lease.pk).reason == "lease_not_active"
    set_meta(lease, pluginId="other-plugin")
    assert export_resume_release_completed(lease_id=lease.pk).reason == "marker_invalid"
    assert export_resume_release_completed(lease_id=uuid.uuid4()).reason == "lease_missing"


# --- settle guards ---------------------------------------------------------------------------


def _pending_export() -> EnvironmentLease:
    run = NativeRunFactory(status="failed")
    lease = EnvironmentLeaseFactory(
        company=run.company, heartbeat_run=run, issue=run.native_issue, status="pending_cleanup"
    )
    marker = export_marker(lease)
    return set_meta(
        lease,
        nativeWorkspaceExportResume=marker,
        pendingCleanupAttemptId="attempt-1",
        pendingCleanupInFlight=True,
        pendingCleanupLeaseExpiresAtMs=1,
        remoteExecutionTermination={"schema": "stale"},
    )


def _stopped(lease: EnvironmentLease) -> dict[str, str]:
    return {"providerLeaseId": str(lease.provider_lease_id), "state": "stopped"}


@pytest.mark.django_db
def test_settle_stopped_releases_and_records_the_receipt() -> None:
    lease = _pending_export()
    settled = export_resume_settle(lease=lease, attempt_id="attempt-1", receipt=_stopped(lease))
    assert settled is not None
    assert (settled.status, settled.cleanup_status) == ("released", "success")
    assert not export_resume_has(settled)
    assert settled.metadata["remoteExecutionTermination"]["state"] == "stopped"
    assert settled.metadata["pendingCleanupInFlight"] is False
    assert settled.metadata["pendingCleanupLeaseExpiresAtMs"] == 0
    assert remote_termination_has(settled)
    assert ActivityEvent.objects.filter(action="environment_lease.cleanup_settled").count() == 1


@pytest.mark.django_db
def test_settle_with_status_expired() -> None:
    lease = _pending_export()
    settled = export_resume_settle(
        lease=lease, attempt_id="attempt-1", receipt=_stopped(lease), status="expired"
    )
    assert settled is not None
    assert settled.status == "expired"


@pytest.mark.django_db
@pytest.mark.parametrize(
    "receipt",
    [
        pytest.param({"state": "destroyed"}, id="destroyed-is-not-a-stop"),
        pytest.param({"state": "failed"}, id="failed"),
        pytest.param({"state": "stopped", "providerLeaseId": "sbx-foreign"}, id="foreign"),
        pytest.param(None, id="no-receipt"),
    ],
)
def test_settle_without_a_bound_stop_keeps_the_marker(receipt: dict[str, str] | None) -> None:
    lease = _pending_export()
    reply = None if receipt is None else {"providerLeaseId": lease.provider_lease_id, **receipt}
    settled = export_resume_settle(lease=lease, attempt_id="attempt-1", receipt=reply)
    assert settled is not None
    assert (settled.status, settled.cleanup_status) == ("pending_cleanup", "failed")
    assert export_resume_read(settled) is not None
    assert "remoteExecutionTermination" not in settled.metadata
    assert settled.metadata["pendingCleanupInFlight"] is False


def _rebind(lease: EnvironmentLease) -> None:
    EnvironmentLease.objects.filter(pk=lease.pk).update(
        heartbeat_run=NativeRunFactory(company=lease.company)
    )


def _newer_attempt(lease: EnvironmentLease) -> None:
    set_meta(EnvironmentLease.objects.get(pk=lease.pk), pendingCleanupAttemptId="attempt-2")


def _new_request(lease: EnvironmentLease) -> None:
    current = EnvironmentLease.objects.get(pk=lease.pk)
    marker = {**current.metadata["nativeWorkspaceExportResume"], "requestId": "req-new"}
    set_meta(current, nativeWorkspaceExportResume=marker)


def _repinned(lease: EnvironmentLease) -> None:
    set_meta(EnvironmentLease.objects.get(pk=lease.pk), pluginId="plugin-other")


def _other_provider(lease: EnvironmentLease) -> None:
    EnvironmentLease.objects.filter(pk=lease.pk).update(provider="e2b")


def _other_company(lease: EnvironmentLease) -> None:
    EnvironmentLease.objects.filter(pk=lease.pk).update(company=CompanyFactory())


def _settled_already(lease: EnvironmentLease) -> None:
    EnvironmentLease.objects.filter(pk=lease.pk).update(status="released")


def _reallocated(lease: EnvironmentLease) -> None:
    EnvironmentLease.objects.filter(pk=lease.pk).update(provider_lease_id="sbx-new")


@pytest.mark.django_db
@pytest.mark.parametrize(
    "change",
    [
        pytest.param(_rebind, id="rebound-lease"),
        pytest.param(_newer_attempt, id="newer-attempt"),
        pytest.param(_new_request, id="new-marker-request"),
        pytest.param(_repinned, id="plugin-pin-changed"),
        pytest.param(_settled_already, id="no-longer-pending"),
        pytest.param(_reallocated, id="allocation-changed"),
        pytest.param(_other_provider, id="provider-changed"),
        pytest.param(_other_company, id="company-changed"),
    ],
)
def test_late_receipt_never_rewrites_a_changed_lease(
    change: Callable[[EnvironmentLease], None],
) -> None:
    lease = _pending_export()  # the snapshot the late receipt was issued against
    change(lease)
    before = EnvironmentLease.objects.get(pk=lease.pk)
    assert (
        export_resume_settle(lease=lease, attempt_id="attempt-1", receipt=_stopped(lease)) is None
    )
    after = EnvironmentLease.objects.get(pk=lease.pk)
    assert (after.status, after.metadata, after.updated_at) == (
        before.status,
        before.metadata,
        before.updated_at,
    )
    assert not ActivityEvent.objects.filter(entity_type="environment_lease").exists()


@pytest.mark.django_db
def test_settle_refuses_a_wrong_attempt_and_an_unreadable_marker() -> None:
    lease = _pending_export()
    assert (
        export_resume_settle(lease=lease, attempt_id="attempt-0", receipt=_stopped(lease)) is None
    )
    set_meta(lease, nativeWorkspaceExportResume={"schema": "broken"})
    assert (
        export_resume_settle(lease=lease, attempt_id="attempt-1", receipt=_stopped(lease)) is None
    )
    assert EnvironmentLease.objects.get(pk=lease.pk).status == "pending_cleanup"
