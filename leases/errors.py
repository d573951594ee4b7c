"""Domain errors of the runtime-lease slice. Codes are frozen once shipped
(docs/api.md#error-codes)."""

from __future__ import annotations

from paperclip.errors import ConflictError, NotFoundError, PermissionDenied


class RuntimeLeaseConflict(ConflictError):
    """A live owner holds the lease; details carry the full holder (docs/leases.md#conflict)."""

    code = "workspace_runtime_lease_conflict"
    message = "Another owner holds the exclusive runtime lease for this execution workspace."
    remediation = (
        "Do not retry against this execution workspace right away. Wait until the owning issue "
        "or run finishes, ask its owner to release the lease, or wait until expires_at; then "
        "claim again."
    )


class RuntimeLeaseContended(ConflictError):
    """The row seen by the insert vanished before it could be locked (a concurrent release)."""

    code = "workspace_runtime_lease_contended"
    message = "The runtime lease changed while it was being claimed."
    remediation = "Retry the claim; it is safe to repeat."


class RuntimeLeaseSuperseded(ConflictError):
    """A fenced write named an owner/generation that no longer holds the lease."""

    code = "workspace_runtime_lease_superseded"
    message = "The runtime lease generation you hold is no longer current."
    remediation = (
        "Stop acting on this workspace: a newer owner holds it (or nobody does). Claim the "
        "lease again and use the generation it returns."
    )


class RuntimeLeaseOwnerIneligible(ConflictError):
    """The caller's own owner is stale: its issue is missing, hidden or not in an eligible
    status, or its run is missing or terminal (the stale verdict's owner part). Such an owner
    neither claims, renews nor writes under the lease (docs/leases.md#owner-eligibility)."""

    code = "workspace_runtime_lease_owner_ineligible"
    message = (
        "Your own issue or run no longer allows you to hold the runtime lease for this "
        "execution workspace."
    )
    remediation = (
        "Stop acting on this workspace for this issue or run: it is finished, hidden or gone "
        "(see reason), and a lease it still holds may be reclaimed by another owner at once. "
        "Do not retry with the same issue or run; claim again only for an issue or run that "
        "is still open."
    )


class ExecutionWorkspaceNotFound(NotFoundError):
    message = "Execution workspace not found."


class OwnerIssueNotFound(NotFoundError):
    message = "Issue not found."


class OwnerRunNotFound(NotFoundError):
    message = "Heartbeat run not found."


class OwnerRunForeign(PermissionDenied):
    """The run is in the company but belongs to another agent (same code as any 403)."""

    message = "The run belongs to another agent; an agent may only claim for its own runs."
