"""Domain errors of the checkpoints app. Codes are frozen once shipped (docs/api.md#error-codes)."""

from __future__ import annotations

from paperclip.errors import ConflictError, RuleViolationError


class ControllerLeaseHeld(ConflictError):
    code = "controller_lease_held"
    message = "Another controller holds an unexpired lease on this run."
    remediation = "Wait for the lease to expire, or present the current lease_owner to renew it."


class ControllerLeaseRunNotNative(RuleViolationError):
    code = "controller_lease_run_not_native"
    message = "Controller leases exist only for native runs bound to an issue."


class ControllerLeaseRunTerminal(ConflictError):
    code = "controller_lease_run_terminal"
    message = "The run has reached a terminal status; no controller may lease it."


class CheckpointOwnerLost(ConflictError):
    code = "native_runner_checkpoint_owner_lost"
    message = "This controller no longer owns the run's checkpoint."
    remediation = (
        "Stop writing checkpoints for this run; acquire a new controller lease before resuming."
    )


class CheckpointBindingMismatch(RuleViolationError):
    code = "native_runner_checkpoint_binding_mismatch"
    message = "The checkpoint is bound to another run, issue or session."


class CheckpointUnreadable(RuleViolationError):
    code = "native_runner_checkpoint_unreadable"
    message = "A stored checkpoint part cannot be decrypted or is bound to another row."
    remediation = (
        "The part was written under a key this server no longer has, or was tampered with; "
        "discard the checkpoint and start the run fresh."
    )
