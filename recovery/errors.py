"""Domain errors of the recovery app (finalization ownership and owner-stop recovery)."""

from __future__ import annotations

from paperclip.errors import ConflictError, NotFoundError, RuleViolationError


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
        "busy/owner_active: another controller is finalizing; retry later. owner_unverified: a "
        "board member must confirm the previous owner stopped. platform_stop_pending: wait for "
        "the worker platform's stop receipt. binding_changed: retry."
    )


class FinalizationOwnershipLostError(ConflictError):
    """The HTTP face of FinalizationOwnershipLost: the finalization stopped mid-way."""

    code = "finalization_ownership_lost"
    message = (
        "Finalization ownership was lost mid-way (lock connection or owner receipt gone); "
        "nothing further was published."
    )
    remediation = "Inspect the run's recovery actions; the reconciler retries if it can."


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


class WorkerStopSignatureInvalid(RuleViolationError):
    code = "worker_stop_signature_invalid"
    message = "The worker stop receipt's signature does not verify."


class WorkerStopPlatformDisabled(RuleViolationError):
    code = "worker_stop_platform_disabled"
    message = "No platform stop secret is configured, so stop receipts cannot be verified."
