"""Domain errors of environment leases and the provider cleanup protocol.

Codes are frozen once shipped; `details` per code:
- `not_found` (404, docs/api.md#company-scoping): none (another company's lease looks the same).
- `cleanup_not_pending`: `status` (the lease's current status).
- `cleanup_in_flight`: `expires_at` (ISO timestamp of the live claim's expiry).
- `cleanup_retry_not_due`: `retry_at` (ISO timestamp the back-off ends), `attempts` (failed
  attempts so far; docs/environment.md#cleanup-retries).
- `cleanup_attempt_stale`: `reason` (see `CleanupAttemptStale`).
- `cleanup_intent_invalid`: `intent` (`nativeWorkspaceExportResume` or `sandboxStopAndRetain`).
- `environment_lease_single_flight`: `environment_id`, `execution_workspace_id`, `lease_id`.
- `environment_archived`: `environment_id` (an archived environment takes no new lease).
- `environment_lease_not_active`: `status`, `outcome` (the outcome the lease was released with).
"""

from __future__ import annotations

from paperclip.errors import ConflictError, NotFoundError, RuleViolationError


class EnvironmentLeaseNotFound(NotFoundError):
    code = "not_found"  # every 404 is `not_found`: nothing reveals what exists
    message = "Environment lease not found."


class CleanupNotPending(ConflictError):
    code = "cleanup_not_pending"
    message = "The environment lease has no pending cleanup."
    remediation = "Only leases in status pending_cleanup can be claimed; refresh your work list."


class CleanupRetryNotDue(ConflictError):
    code = "cleanup_retry_not_due"
    message = "The last cleanup attempt failed; the next one may start after its back-off."
    remediation = "Do not touch the allocation yet; claim again after details.retry_at."


class CleanupInFlight(ConflictError):
    code = "cleanup_in_flight"
    message = "Another worker holds a live claim on this cleanup."
    remediation = "Do not touch the allocation; retry after the claim's expires_at."


class CleanupAttemptStale(ConflictError):
    """The receipt does not answer the lease's current claim.

    `reason`: `not_pending` (already settled or never pending), `not_claimed` (no live claim),
    `attempt_mismatch` (a newer claim superseded this attempt), `provider_lease_mismatch`
    (the receipt names another allocation), `lease_changed` (the lease was rebound since).
    """

    code = "cleanup_attempt_stale"
    message = "The cleanup receipt does not answer the lease's current cleanup attempt."
    remediation = "Discard this receipt; nothing was changed."


class CleanupIntentInvalid(RuleViolationError):
    code = "cleanup_intent_invalid"
    message = (
        "The lease carries a stop-only intent that does not bind to it; it must not be cleaned "
        "up automatically."
    )
    remediation = "An operator must inspect the lease metadata."


class EnvironmentNotFound(NotFoundError):
    code = "not_found"
    message = "Environment not found."


class EnvironmentArchived(ConflictError):
    """details: `environment_id`."""

    code = "environment_archived"
    message = "The environment is archived: it takes no new leases."
    remediation = (
        "Acquire in an active environment (an archived one keeps only its existing leases)."
    )


class EnvironmentLeaseSingleFlight(ConflictError):
    """details: `environment_id`, `execution_workspace_id`, `lease_id` (the active ephemeral
    lease that holds the slot; same company, so naming it reveals nothing)."""

    code = "environment_lease_single_flight"
    message = (
        "An active ephemeral lease already holds this environment for this execution workspace."
    )
    remediation = "Wait for the holder to release it, or acquire with a reusable policy."


class EnvironmentLeaseNotActive(ConflictError):
    """details: `status` (the lease's current status), `outcome` (the recorded release outcome,
    or null)."""

    code = "environment_lease_not_active"
    message = "The environment lease is not active."
    remediation = "Acquire a new lease; a release is repeatable only with the same outcome."
