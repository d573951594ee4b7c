"""Domain errors: expected, client-visible failures with stable snake_case codes.

Services raise these; `paperclip.api.errors` maps the kind to an HTTP status and renders
`{"error": {"code", "message", "details", "remediation"?}}`. `code` is frozen once shipped.
"""

from __future__ import annotations

from typing import Any, ClassVar


class DomainError(Exception):
    """Expected failure. Subclass one of the kinds below and set `code` and `message`."""

    code: ClassVar[str] = "domain_error"
    message: ClassVar[str] = "The request could not be completed."
    remediation: ClassVar[str | None] = None
    status_code: ClassVar[int] = 400
    retry_after_seconds: ClassVar[int | None] = None  # sent as Retry-After (a 503)

    def __init__(
        self, message: str | None = None, *, remediation: str | None = None, **details: Any
    ) -> None:
        self.text = message or self.message
        super().__init__(self.text)
        self.details = details
        self.remediation_text = remediation if remediation is not None else self.remediation


class InvalidRequest(DomainError):  # 400
    code = "invalid_request"
    message = "The request is malformed."
    status_code = 400


class PermissionDenied(DomainError):  # 403
    code = "permission_denied"
    message = "You do not have permission to perform this action."
    status_code = 403


class NotFoundError(DomainError):  # 404
    code = "not_found"
    message = "Not found."
    status_code = 404


class ConflictError(DomainError):  # 409: state or lock conflict
    code = "conflict"
    message = "The request conflicts with the current state."
    status_code = 409


class RuleViolationError(DomainError):  # 422: well-formed but not allowed
    code = "rule_violation"
    message = "The request is well-formed but not allowed."
    status_code = 422


class PayloadTooLargeError(DomainError):  # 413: a body or a part of it over a size limit
    code = "payload_too_large"
    message = "The content is larger than the server accepts."
    status_code = 413


class ResourceBusy(ConflictError):
    code = "resource_busy"
    message = "The resource is locked by another request; retry shortly."


class InvalidRunTransition(RuleViolationError):
    code = "invalid_run_transition"
    message = "The run cannot move to that status."


class IssueExecutionLocked(ConflictError):
    code = "issue_execution_locked"
    message = "Another live run holds the issue's execution lock."


class AgentNotActive(RuleViolationError):
    code = "agent_not_active"
    message = "The agent is paused or terminated and cannot start runs."


class BoardUserInactive(RuleViolationError):
    code = "board_user_inactive"
    message = "The user is inactive and cannot act as the board."


class WorkspaceCwdNotAllowed(RuleViolationError):
    code = "workspace_cwd_not_allowed"
    message = (
        "The cwd is, holds or lies inside another company's workspace, the data directory or"
        " the blob store; only a superuser may give a workspace such a cwd."
    )
