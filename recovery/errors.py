"""Domain errors of the recovery app: finalization ownership, owner-stop recovery, worker
stop receipts, and (the second half of this module) recovery-source inspection failures."""

from __future__ import annotations

from typing import Any, ClassVar, Final, Literal

from leases.models import EnvironmentLease
from paperclip.errors import ConflictError, DomainError, NotFoundError, RuleViolationError


class FinalizationOwnershipLost(Exception):
    """Raised by `assert_held()` when the lock connection, our receipt or the recovery result
    is gone. Not a client-facing error: the finalization stops and publishes nothing more."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"native_workspace_finalization_ownership_lost: {reason}")
        self.reason = reason


class FinalizationBindingMissing(RuleViolationError):
    code = "finalization_binding_missing"
    message = "The run is not a native run of this company, so it has no workspace finalization."


class FinalizationNotAcquired(ConflictError):
    code = "finalization_not_acquired"
    message = "Workspace finalization ownership was not acquired."
    remediation = (
        "owner_unverified: a board member must confirm that the previous owner stopped (admin, "
        "or POST /api/issues/{issue_id}/recovery-actions/resume-workspace-finalization); the "
        "worker then finalizes the saved result. platform_stop_pending: wait for the worker "
        "platform's stop receipt; the reconciler looks for it again every period."
    )


class FinalizationFailed(ConflictError):
    code = "finalization_failed"
    message = "The finalization attempt failed and the retry budget is spent."
    remediation = (
        "details.last_error says why (copy-back); fix the cause, then POST .../finalize again "
        "(each explicit request makes one more attempt)."
    )


class FinalizationNotReady(ConflictError):
    code = "finalization_not_ready"
    message = "The run has no accepted result waiting for workspace finalization."


class RunNotFinalizable(ConflictError):
    code = "run_not_finalizable"
    message = "The run can no longer accept a result."


class NativeResultConflict(ConflictError):
    code = "native_result_conflict"
    message = "The run already has a different accepted result."


class CopybackSourceMissing(RuleViolationError):
    code = "workspace_copyback_source_missing"
    message = "The run has no usable workspace directory or destination to copy back."


class SnapshotNotRegistered(ConflictError):
    code = "snapshot_not_registered"
    message = "The result names a workspace tree this run has not registered."
    remediation = "Register the snapshot (POST .../snapshots) first, then post the result."


class WorkspaceCopybackNotAllowed(ConflictError):
    code = "workspace_copyback_not_allowed"
    message = "The run's workspace directory may not be copied back."
    remediation = (
        "Send the work as a tree: register a snapshot (POST .../snapshots) and post the result "
        "with workspace_tree. The legacy copy-back reads only a directory inside one of "
        "PAPERCLIP_COPYBACK_ROOTS that is not, does not hold and does not lie in a workspace cwd, "
        "the data directory or the store (details.reason says which rule refused it)."
    )


class WorkspaceConflictStale(ConflictError):
    code = "workspace_conflict_stale"
    message = "The workspace conflict hold is not live for this run any more."


class WorkspaceHeadMoved(ConflictError):
    code = "workspace_head_moved"
    message = "The workspace head moved since it was read (details.head is the head of now)."
    remediation = "Read the conflict's preview again against the new head, then decide."


class WorkspaceConflictUnreadable(ConflictError):
    code = "workspace_conflict_unreadable"
    message = "A tree of the conflict is no longer readable from the store."


class RecoveryActionNotFound(NotFoundError):
    code = "not_found"
    message = "Recovery action not found."


class RecoveryHoldNotDismissable(RuleViolationError):
    code = "recovery_hold_not_dismissable"
    message = (
        "An unverified workspace-owner hold is resolved only by finalizing the saved result, "
        "not by generic recovery resolution."
    )


class WorkspaceCopybackActive(ConflictError):
    code = "workspace_copyback_active"
    message = "Workspace copy-back is still active. Wait for it to stop before confirming."


class WorkspaceControllerAlive(ConflictError):
    code = "workspace_controller_alive"
    message = "The previous workspace controller is still running on this host."
    remediation = "Stop the recorded controller process and its copy-back children first."


class WorkspaceOwnerRecoveryStale(ConflictError):
    code = "workspace_owner_recovery_stale"
    message = "The recorded workspace owner is no longer current. Refresh and inspect the run."


class WorkspaceExportRetryStale(ConflictError):
    code = "workspace_export_retry_stale"
    message = (
        "The export hold is no longer current: the saved result, its owner, what it exports or "
        "its sandbox lease changed. Refresh and inspect the run."
    )


class WorkspaceExportStopUnconfirmed(ConflictError):
    code = "workspace_export_stop_unconfirmed"
    message = "The provider has not confirmed that the run's sandbox stopped."
    remediation = (
        "Stop the sandbox through its provider: its environment lease's stop-only cleanup "
        "(claim, then a `stopped` receipt), or Retry cleanup now on the lease in the console; "
        "then retry the export."
    )


class WorkerStopSignatureInvalid(RuleViolationError):
    code = "worker_stop_signature_invalid"
    message = "The worker stop receipt's signature does not verify."


class WorkerStopPlatformDisabled(RuleViolationError):
    code = "worker_stop_platform_disabled"
    message = "No platform stop secret is configured, so stop receipts cannot be verified."


# --- recovery-source inspection failures ------------------------------------------------
# Failures of recovery-source inspection (docs/recovery.md#recovery-source-failure-codes).
#
# `SourceFailure(code, disposition, reason=None, observed_lease_policy=None)` builds the
# subclass for `code`, so the HTTP status follows the code: 422 for `source_binding_invalid`,
# `historical_source_missing`, `allocation_ownership_ambiguous`, `source_unavailable`; 409 for
# `agent_stop_unconfirmed`, `workspace_writer_active`. Details: `{"disposition", "reason"?,
# "observed_lease_policy"?}`.

Disposition = Literal["service_required", "use_alternative_strategy", "recheck_evidence"]
DISPOSITIONS: Final = frozenset(
    {"service_required", "use_alternative_strategy", "recheck_evidence"}
)

# WorkspaceSourceVerificationFailure["reason"]: the reasons of `source_binding_invalid`.
BINDING_REASONS: Final = (
    "source_run_missing",
    "recovery_action_missing",
    "recovery_action_run_mismatch",
    "source_run_not_terminal",
    "source_issue_mismatch",
    "native_reference_invalid",
    "workspace_reference_mismatch",
    "restore_reference_invalid",
    "historical_reference_invalid",
    "lease_reference_invalid",
    "source_lease_not_bound",
    "lease_issue_mismatch",
    "lease_environment_missing",
    "lease_allocation_missing",
    "lease_provider_invalid",
    "lease_policy_not_retained",
    "lease_cwd_invalid",
    "allocation_reference_mismatch",
    "cwd_reference_mismatch",
    "recovery_lease_not_selected",
    "recovery_environment_mismatch",
    "recovery_lease_not_claimed",
    "recovery_owner_mismatch",
    "recovery_stop_intent_missing",
)


class SourceFailure(DomainError):
    """A recovery source that cannot be trusted, with what the operator should do next."""

    _by_code: ClassVar[dict[str, type[SourceFailure]]] = {}

    def __new__(
        cls,
        code: str,
        disposition: str,
        reason: str | None = None,
        observed_lease_policy: str | None = None,
    ) -> SourceFailure:
        target = cls._by_code.get(code) if cls is SourceFailure else cls
        if target is None:
            raise ValueError(f"unknown recovery source failure code {code!r}")
        return super().__new__(target)

    def __init__(
        self,
        code: str,
        disposition: str,
        reason: str | None = None,
        observed_lease_policy: str | None = None,
    ) -> None:
        if code != self.code or disposition not in DISPOSITIONS:
            raise ValueError(f"invalid recovery source failure {code!r}/{disposition!r}")
        if reason is not None and reason not in BINDING_REASONS:
            raise ValueError(f"unknown source binding reason {reason!r}")
        details: dict[str, Any] = {"disposition": disposition}
        if reason is not None:
            details["reason"] = reason
        if observed_lease_policy is not None:
            details["observed_lease_policy"] = observed_lease_policy
        super().__init__(**details)
        self.disposition = disposition
        self.reason = reason
        self.observed_lease_policy = observed_lease_policy

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        SourceFailure._by_code[cls.code] = cls


class SourceBindingInvalid(SourceFailure, RuleViolationError):
    code = "source_binding_invalid"
    message = "The recovery source does not bind to the failed run's recorded workspace."


class HistoricalSourceMissing(SourceFailure, RuleViolationError):
    code = "historical_source_missing"
    message = "The failed run recorded no workspace source to recover from."
    remediation = "Use another recovery strategy (a fresh isolated workspace)."


class AllocationOwnershipAmbiguous(SourceFailure, RuleViolationError):
    code = "allocation_ownership_ambiguous"
    message = "The provider allocation's ownership history is not a clean hand-off chain."
    remediation = "An operator must establish who owns the allocation."


class SourceUnavailable(SourceFailure, RuleViolationError):
    code = "source_unavailable"
    message = "The recovery source's environment no longer exists."


class AgentStopUnconfirmed(SourceFailure, ConflictError):
    code = "agent_stop_unconfirmed"
    message = "The source run's agent or controller may still be running."
    remediation = "Re-check once the run's controller lease and finalization owner are gone."


class WorkspaceWriterActive(SourceFailure, ConflictError):
    code = "workspace_writer_active"
    message = "Another queued or running run may write to the source workspace."
    remediation = "Re-check after that run ends."


def binding_failure(reason: str, policy: object = None) -> SourceFailure:
    """`source_binding_invalid` / `service_required` for `reason`; for
    `lease_policy_not_retained` the observed policy (or `unrecognized`) is attached."""
    observed: str | None = None
    if reason == "lease_policy_not_retained":
        recognised = isinstance(policy, str) and policy in EnvironmentLease.Policy.values
        observed = str(policy) if recognised else "unrecognized"
    return SourceFailure("source_binding_invalid", "service_required", reason, observed)


class SourceInspectionLimit(RuleViolationError):
    """More source leases than the caller allows (`maximum_sources`); details
    `{"maximum_sources", "recorded"}` (docs/recovery.md#recovery-source-failure-codes)."""

    code = "source_inspection_limit"
    message = "The failed run recorded more source leases than this inspection allows."
