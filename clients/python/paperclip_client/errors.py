"""Exceptions: one class per error code of the API, plus the transport failures.

Every error body of the API has one shape, `{"error": {"code", "message", "details",
"remediation"?}}`; `ApiError.from_response` turns it into the class registered for its code
(`ERRORS`), or into the class of its HTTP status kind when the code is new to this client.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar


class PaperclipError(Exception):
    """Base of everything this library raises."""


class ServerUnreachable(PaperclipError):
    """The request never reached the server (connection refused, DNS, connect timeout), or
    retries ran out on answers that say nothing was changed. Safe to retry later."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"cannot reach {url}: {reason}")
        self.url = url
        self.reason = reason


class OutcomeUnknown(PaperclipError):
    """The request was sent but no answer came back (read timeout, connection dropped): the
    server may or may not have applied it. Raised for writes that are not safe to repeat
    blindly (fenced writes, checkpoint writes); re-read the state before deciding."""

    def __init__(self, method: str, path: str, reason: str) -> None:
        super().__init__(f"{method} {path}: no answer ({reason}); the outcome is unknown")
        self.method = method
        self.path = path
        self.reason = reason


class WorkdirError(PaperclipError):
    """The workdir cannot be snapshotted or checked out as asked."""


class WorkdirChanged(WorkdirError):
    """A file changed while it was being snapshotted."""


class LocalChanges(WorkdirError):
    """Checkout would overwrite or delete local work: `paths` (every one; the message names
    up to 20) differ from both the head and the tree the workdir last held."""

    def __init__(self, paths: Sequence[str]) -> None:
        shown = ", ".join(paths[:20]) + (
            f" (and {len(paths) - 20} more)" if len(paths) > 20 else ""
        )
        super().__init__(
            f"{len(paths)} path(s) in the workdir hold local changes that checkout would"
            f" overwrite: {shown}; keep them elsewhere or pass --discard-local-changes"
        )
        self.paths = list(paths)


class TreeError(ValueError):
    """A directory blob the client will not act on (`path`: where; `reason`: why)."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path or '/'}: {reason}")
        self.path = path
        self.reason = reason


class CheckpointError(Exception):
    """The checkpoint cannot be saved or restored as asked."""


class BlobCorrupt(PaperclipError):
    """A blob downloaded from the store does not hash to its name (nothing was kept)."""

    def __init__(self, name: str, size: int) -> None:
        super().__init__(f"the {size} bytes received for {name} do not match that name")
        self.name = name
        self.size = size


class ApiError(PaperclipError):
    """An error answer of the API. `code` is stable; `message` is human text; `details`
    is documented per code; `remediation` says what to do, when the server knows."""

    code: ClassVar[str] = "error"
    status: int
    message: str
    details: dict[str, Any]
    remediation: str | None
    request_id: str | None

    def __init__(
        self,
        message: str,
        *,
        status: int,
        code: str | None = None,
        details: dict[str, Any] | None = None,
        remediation: str | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code  # type: ignore[misc]  # an unregistered code on a generic class
        self.status = status
        self.message = message
        self.details = details or {}
        self.remediation = remediation
        self.request_id = request_id

    def __str__(self) -> str:
        text = f"{self.code}: {self.message}"
        return f"{text} ({self.remediation})" if self.remediation else text

    @staticmethod
    def from_body(status: int, body: Any, *, request_id: str | None = None) -> ApiError:
        error = body.get("error") if isinstance(body, dict) else None
        if not isinstance(error, dict):
            return _KIND_BY_STATUS.get(status, ApiError)(
                f"HTTP {status} without an error body", status=status, code=f"http_{status}"
            )
        code = str(error.get("code") or f"http_{status}")
        details = error.get("details")
        remediation = error.get("remediation")
        cls = ERRORS.get(code)
        kwargs: dict[str, Any] = {
            "status": status,
            "details": details if isinstance(details, dict) else {},
            "remediation": remediation if isinstance(remediation, str) else None,
            "request_id": request_id,
        }
        message = str(error.get("message") or code)
        if cls is None:
            return _KIND_BY_STATUS.get(status, ApiError)(message, code=code, **kwargs)
        return cls(message, **kwargs)


# --- kinds (HTTP status) --------------------------------------------------------------------


class InvalidRequest(ApiError):
    """400: malformed body or parameters; `details["fields"]` names them."""

    code = "invalid_request"

    @property
    def fields(self) -> dict[str, Any]:
        fields = self.details.get("fields")
        return fields if isinstance(fields, dict) else {}


class NotAuthenticated(ApiError):
    code = "not_authenticated"


class PermissionDenied(ApiError):
    code = "permission_denied"


class NotFound(ApiError):
    code = "not_found"


class ConflictError(ApiError):
    """409: a state or lock conflict."""

    code = "conflict"


class RuleViolation(ApiError):
    """422: well-formed but not allowed."""

    code = "rule_violation"


class DatabaseUnavailable(ApiError):
    """503: the server lost its database mid-request; nothing was changed. Retried."""

    code = "database_unavailable"


class BlobStoreUnavailable(ApiError):
    """503: the server's blob store (an S3 bucket, say) cannot be reached; nothing was
    changed. Retried, honouring Retry-After."""

    code = "blob_store_unavailable"


class BlobUnreadable(RuleViolation):
    """422: the store holds the blob (`details["digest"]`) but its bytes are gone or do not
    hash to its name; they are never served as it. Upload the blob again."""

    code = "blob_unreadable"


_KIND_BY_STATUS: dict[int, type[ApiError]] = {
    400: InvalidRequest,
    401: NotAuthenticated,
    403: PermissionDenied,
    404: NotFound,
    409: ConflictError,
    422: RuleViolation,
    503: DatabaseUnavailable,
}


# --- 409 conflicts --------------------------------------------------------------------------


class ResourceBusy(ConflictError):
    """A row lock was not granted in time; nothing changed. Retried."""

    code = "resource_busy"


class WorkspaceRuntimeLeaseConflict(ConflictError):
    """Another owner holds the workspace's runtime lease (`details`: owner_key, generation,
    expires_at, ...)."""

    code = "workspace_runtime_lease_conflict"


class WorkspaceRuntimeLeaseContended(ConflictError):
    code = "workspace_runtime_lease_contended"


class WorkspaceRuntimeLeaseOwnerIneligible(ConflictError):
    code = "workspace_runtime_lease_owner_ineligible"


class WorkspaceRuntimeLeaseSuperseded(ConflictError):
    """A fenced write presented a generation that no longer holds the lease."""

    code = "workspace_runtime_lease_superseded"


class IssueExecutionLocked(ConflictError):
    """Another live run holds the issue (`details["holder_run_id"]`)."""

    code = "issue_execution_locked"


class ControllerLeaseHeld(ConflictError):
    code = "controller_lease_held"


class ControllerLeaseRunTerminal(ConflictError):
    code = "controller_lease_run_terminal"


class NativeRunnerCheckpointOwnerLost(ConflictError):
    code = "native_runner_checkpoint_owner_lost"


class NativeResultConflict(ConflictError):
    code = "native_result_conflict"


class RunNotFinalizable(ConflictError):
    code = "run_not_finalizable"


class FinalizationNotReady(ConflictError):
    code = "finalization_not_ready"


class FinalizationNotAcquired(ConflictError):
    """The run is held for the board (`details["reason"]`)."""

    code = "finalization_not_acquired"


class FinalizationFailed(ConflictError):
    code = "finalization_failed"


class CleanupNotPending(ConflictError):
    code = "cleanup_not_pending"


class CleanupInFlight(ConflictError):
    code = "cleanup_in_flight"


class CleanupRetryNotDue(ConflictError):
    code = "cleanup_retry_not_due"


class CleanupAttemptStale(ConflictError):
    code = "cleanup_attempt_stale"


class EnvironmentLeaseSingleFlight(ConflictError):
    code = "environment_lease_single_flight"


class EnvironmentArchived(ConflictError):
    """409: the environment is archived and takes no new lease (`details["environment_id"]`)."""

    code = "environment_archived"


class EnvironmentLeaseNotActive(ConflictError):
    code = "environment_lease_not_active"


class WorkspaceCopybackActive(ConflictError):
    code = "workspace_copyback_active"


class WorkspaceControllerAlive(ConflictError):
    code = "workspace_controller_alive"


class WorkspaceOwnerRecoveryStale(ConflictError):
    code = "workspace_owner_recovery_stale"


# --- 422 rule violations --------------------------------------------------------------------


class InvalidRunTransition(RuleViolation):
    code = "invalid_run_transition"


class AgentNotActive(RuleViolation):
    code = "agent_not_active"


class ControllerLeaseRunNotNative(RuleViolation):
    code = "controller_lease_run_not_native"


class NativeRunnerCheckpointBindingMismatch(RuleViolation):
    code = "native_runner_checkpoint_binding_mismatch"


class NativeRunnerCheckpointUnreadable(RuleViolation):
    """A stored part failed to decrypt (`details["part"]`, `details["reason"]`)."""

    code = "native_runner_checkpoint_unreadable"


class SnapshotBlobsMissing(ConflictError):
    """A snapshot names blobs the store lacks (`details["missing"]`, at most 1,000)."""

    code = "snapshot_blobs_missing"


class SnapshotNotRegistered(ConflictError):
    """A result names a `workspace_tree` the run did not register."""

    code = "snapshot_not_registered"


class WorkspaceCopybackNotAllowed(ConflictError):
    """A result without `workspace_tree` whose run's `workspace_dir` the server's legacy
    copy-back may not read (`details["reason"]`): send the work as a tree."""

    code = "workspace_copyback_not_allowed"


class BlobDigestMismatch(InvalidRequest):
    """The uploaded bytes do not hash to the blob's name (`details["digest"]`)."""

    code = "blob_digest_mismatch"


class SnapshotTreeInvalid(InvalidRequest):
    """A malformed or hostile tree (`details["path"]`, `details["reason"]`)."""

    code = "snapshot_tree_invalid"


class BlobTooLarge(ApiError):
    """413: a blob over the store's limit (`details["max_bytes"]`)."""

    code = "blob_too_large"


class RequestTooLarge(ApiError):
    """413: a request body over the server's limit (`details["max_bytes"]`), e.g. a batch
    upload larger than `max_batch_bytes`."""

    code = "request_too_large"


class FinalizationBindingMissing(RuleViolation):
    code = "finalization_binding_missing"


class CleanupIntentInvalid(RuleViolation):
    code = "cleanup_intent_invalid"


def _registry() -> dict[str, type[ApiError]]:
    found: dict[str, type[ApiError]] = {}
    pending: list[type[ApiError]] = [ApiError]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if cls is not ApiError:
            found[cls.code] = cls
    return found


ERRORS: dict[str, type[ApiError]] = _registry()
"""Error code -> exception class, for every code this client knows."""
