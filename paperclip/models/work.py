"""The work itself: issues and the heartbeat runs that execute them."""

from __future__ import annotations

import uuid
from typing import Any, ClassVar

from django.db import models

from paperclip.models.base import TimestampedModel
from paperclip.models.tenancy import Agent, Company
from paperclip.models.workspaces import ExecutionWorkspace


class Issue(TimestampedModel):
    class Status(models.TextChoices):
        BACKLOG = "backlog"
        TODO = "todo"
        IN_PROGRESS = "in_progress"
        IN_REVIEW = "in_review"
        BLOCKED = "blocked"
        DONE = "done"
        CANCELLED = "cancelled"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    company = models.ForeignKey(Company, on_delete=models.CASCADE, related_name="issues")
    title = models.TextField()
    status = models.TextField(choices=Status.choices, default=Status.BACKLOG)
    hidden_at = models.DateTimeField(null=True, blank=True)
    assignee_agent = models.ForeignKey(
        Agent, on_delete=models.SET_NULL, null=True, blank=True, related_name="assigned_issues"
    )
    execution_run = models.ForeignKey(
        "HeartbeatRun", on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    checkout_run = models.ForeignKey(
        "HeartbeatRun", on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    execution_locked_at = models.DateTimeField(null=True, blank=True)
    execution_workspace = models.ForeignKey(
        ExecutionWorkspace, on_delete=models.SET_NULL, null=True, blank=True, related_name="issues"
    )

    class Meta:
        db_table = "issues"
        indexes: ClassVar[list[models.Index]] = [
            models.Index(fields=["company", "status"], name="issues_company_status_idx"),
            models.Index(
                fields=["company", "execution_workspace"], name="issues_company_exec_ws_idx"
            ),
        ]
        constraints: ClassVar[list[Any]] = [
            # Target of composite foreign keys (company_id, id) from scoped children.
            models.UniqueConstraint(fields=["company", "id"], name="issues_company_id_uq")
        ]

    def __str__(self) -> str:
        return self.title


class HeartbeatRun(TimestampedModel):
    class Status(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        SUCCEEDED = "succeeded"
        FAILED = "failed"
        CANCELLED = "cancelled"
        TIMED_OUT = "timed_out"
        INTERRUPTED = "interrupted"

    # In declaration order (API enums list them so); the frozenset is for membership tests.
    TERMINAL_STATUS_VALUES: ClassVar[tuple[str, ...]] = (
        "succeeded",
        "failed",
        "cancelled",
        "timed_out",
        "interrupted",
    )
    TERMINAL_STATUSES: ClassVar[frozenset[str]] = frozenset(TERMINAL_STATUS_VALUES)
    LIVE_STATUSES: ClassVar[frozenset[str]] = frozenset({"queued", "running"})

    class RuntimeMode(models.TextChoices):
        NATIVE = "native"
        LEGACY = "legacy"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    company = models.ForeignKey(Company, on_delete=models.CASCADE, related_name="runs")
    agent = models.ForeignKey(Agent, on_delete=models.CASCADE, related_name="runs")
    issue = models.ForeignKey(
        Issue, on_delete=models.SET_NULL, null=True, blank=True, related_name="runs"
    )
    status = models.TextField(choices=Status.choices, default=Status.QUEUED)
    runtime_mode = models.TextField(choices=RuntimeMode.choices, default=RuntimeMode.LEGACY)
    native_issue = models.ForeignKey(
        Issue, on_delete=models.SET_NULL, null=True, blank=True, related_name="native_runs"
    )
    execution_workspace = models.ForeignKey(
        ExecutionWorkspace, on_delete=models.SET_NULL, null=True, blank=True, related_name="runs"
    )
    context_snapshot = models.JSONField(null=True, blank=True)
    runner_profile_json = models.JSONField(null=True, blank=True)
    result_json = models.JSONField(null=True, blank=True)
    controller_boot_id = models.UUIDField(null=True, blank=True)
    controller_lease_expires_at = models.DateTimeField(null=True, blank=True)
    execution_stage = models.TextField(null=True, blank=True)
    completion_contract_id = models.UUIDField(null=True, blank=True)
    native_phase = models.TextField(null=True, blank=True)
    native_phase_updated_at = models.DateTimeField(null=True, blank=True)
    native_session_id = models.UUIDField(null=True, blank=True)
    process_pid = models.IntegerField(null=True, blank=True)
    process_started_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "heartbeat_runs"
        indexes: ClassVar[list[models.Index]] = [
            models.Index(fields=["company", "status"], name="runs_company_status_idx"),
            # Runs in one status across companies: the admin's status filter and its count.
            models.Index(fields=["status"], name="runs_status_idx"),
            models.Index(fields=["company", "agent", "status"], name="runs_company_agent_idx"),
            models.Index(fields=["company", "issue", "created_at"], name="runs_company_issue_idx"),
            models.Index(
                fields=["company", "native_issue", "created_at"], name="runs_company_native_idx"
            ),
            models.Index(
                fields=["company", "execution_workspace", "status"], name="runs_company_ws_idx"
            ),
        ]
        constraints: ClassVar[list[Any]] = [
            models.UniqueConstraint(
                fields=["company", "native_issue", "id"],
                name="heartbeat_runs_company_native_issue_id_uq",
            ),
        ]

    def __str__(self) -> str:
        return f"run {self.id}"

    @property
    def is_terminal(self) -> bool:
        return self.status in self.TERMINAL_STATUSES
