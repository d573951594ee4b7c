"""What a run leaves behind: its workspace operations (the copy-back barrier among them),
the results its runner reported, and the per-run coordinator of its finalization."""

from __future__ import annotations

import uuid
from typing import Any, ClassVar

from django.db import models
from django.db.models import Q
from django.db.models.functions import Now

from paperclip.models.base import TimestampedModel
from paperclip.models.tenancy import Agent, Company
from paperclip.models.work import HeartbeatRun, Issue
from paperclip.models.workspaces import ExecutionWorkspace


class WorkspaceOperation(TimestampedModel):
    """A workspace operation (docs/data-model.md#workspace-operations). A `workspace_finalize` row
    with status `succeeded` is the durable copy-back barrier."""

    class Status(models.TextChoices):
        RUNNING = "running"
        SUCCEEDED = "succeeded"
        FAILED = "failed"

    PHASE_WORKSPACE_FINALIZE: ClassVar[str] = "workspace_finalize"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    company = models.ForeignKey(Company, on_delete=models.CASCADE, related_name="+")
    execution_workspace = models.ForeignKey(
        ExecutionWorkspace,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="operations",
    )
    heartbeat_run = models.ForeignKey(
        HeartbeatRun, on_delete=models.SET_NULL, null=True, blank=True, related_name="operations"
    )
    actor_agent = models.ForeignKey(
        Agent, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    actor_user_id = models.TextField(null=True, blank=True)
    actor_run_id = models.UUIDField(null=True, blank=True)
    issue = models.ForeignKey(
        Issue, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    phase = models.TextField()
    command = models.TextField(null=True, blank=True)
    cwd = models.TextField(null=True, blank=True)
    status = models.TextField(choices=Status.choices, default=Status.RUNNING)
    exit_code = models.IntegerField(null=True, blank=True)
    # Fencing token under which a runtime-lease-guarded operation was accepted (beyond upstream).
    lease_generation = models.BigIntegerField(null=True, blank=True)
    metadata = models.JSONField(null=True, blank=True)
    started_at = models.DateTimeField(db_default=Now())
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "workspace_operations"
        indexes: ClassVar[list[models.Index]] = [
            models.Index(
                fields=["company", "heartbeat_run", "started_at"], name="ws_ops_company_run_idx"
            ),
            models.Index(
                fields=["company", "execution_workspace", "started_at"],
                name="ws_ops_company_ws_idx",
            ),
            models.Index(
                fields=["company", "heartbeat_run", "issue", "phase", "status"],
                name="ws_ops_barrier_idx",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.phase} ({self.status})"


class NativeRunResult(models.Model):
    """A runner's reported result for a native run (docs/data-model.md#native-run-results)."""

    class SchemaStatus(models.TextChoices):
        ACCEPTED = "accepted"
        REJECTED = "rejected"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    company = models.ForeignKey(Company, on_delete=models.CASCADE, related_name="+")
    issue = models.ForeignKey(Issue, on_delete=models.CASCADE, related_name="+")
    run = models.ForeignKey(HeartbeatRun, on_delete=models.CASCADE, related_name="native_results")
    turn_id = models.TextField(null=True, blank=True)
    completion_contract_id = models.UUIDField()
    caller_result_id = models.TextField(null=True, blank=True)
    caller_dedupe_key = models.TextField(null=True, blank=True)
    server_fingerprint = models.TextField()
    schema_status = models.TextField(choices=SchemaStatus.choices)
    rejection_code = models.TextField(null=True, blank=True)
    result_json = models.JSONField()
    canonical_sha256 = models.TextField()
    created_at = models.DateTimeField(db_default=Now(), editable=False)

    class Meta:
        db_table = "native_run_results"
        constraints: ClassVar[list[Any]] = [
            models.UniqueConstraint(
                fields=["run", "server_fingerprint"], name="native_run_results_run_fingerprint_uq"
            ),
            models.UniqueConstraint(
                fields=["run", "caller_result_id"], name="native_run_results_run_caller_uq"
            ),
            models.UniqueConstraint(
                fields=["run", "caller_dedupe_key"], name="native_run_results_run_dedupe_uq"
            ),
        ]

    def __str__(self) -> str:
        return f"result {self.id} ({self.schema_status})"


class NativeRunFinalization(TimestampedModel):
    """The per-run coordinator (docs/data-model.md#run-coordinators): finalization phase, the
    controller lease used by runners (fencing their checkpoints), and the accepted result."""

    class Phase(models.TextChoices):
        OBSERVED = "observed"
        RESULT_ACCEPTED = "result_accepted"
        WORKSPACE_FINALIZING = "workspace_finalizing"
        COMMITTED = "committed"
        TERMINAL_FAILURE = "terminal_failure"
        RETRYABLE_FAILURE = "retryable_failure"
        APPLIED = "applied"

    run = models.OneToOneField(
        HeartbeatRun, on_delete=models.CASCADE, primary_key=True, related_name="finalization"
    )
    company = models.ForeignKey(Company, on_delete=models.CASCADE, related_name="+")
    issue = models.ForeignKey(Issue, on_delete=models.CASCADE, related_name="+")
    phase = models.TextField(choices=Phase.choices, default=Phase.OBSERVED)
    attempt = models.IntegerField(default=0)
    lease_owner = models.TextField(null=True, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    controller_boot_id = models.TextField(null=True, blank=True)
    controller_pid = models.IntegerField(null=True, blank=True)
    controller_process_started_at = models.DateTimeField(null=True, blank=True)
    controller_generation = models.IntegerField(default=0)
    recovery_state = models.TextField(null=True, blank=True)
    recovery_request_id = models.TextField(null=True, blank=True)
    recovery_history = models.JSONField(default=list, blank=True)
    result = models.ForeignKey(
        NativeRunResult, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    assessment_id = models.UUIDField(null=True, blank=True)
    decision_id = models.UUIDField(null=True, blank=True)
    failure_code = models.TextField(null=True, blank=True)
    failure_detail = models.JSONField(null=True, blank=True)
    control_deadline_at = models.DateTimeField(null=True, blank=True)
    next_attempt_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "native_run_finalizations"
        indexes: ClassVar[list[models.Index]] = [
            models.Index(fields=["company", "phase"], name="native_fin_company_phase_idx"),
            models.Index(
                fields=["control_deadline_at"],
                name="native_fin_deadline_idx",
                condition=Q(control_deadline_at__isnull=False),
            ),
        ]
        constraints: ClassVar[list[Any]] = [
            models.CheckConstraint(
                condition=Q(assessment_id__isnull=True) | Q(result__isnull=False),
                name="native_fin_assessment_requires_result",
            ),
            models.CheckConstraint(
                condition=Q(decision_id__isnull=True) | Q(assessment_id__isnull=False),
                name="native_fin_decision_requires_assessment",
            ),
        ]

    def __str__(self) -> str:
        return f"coordinator {self.run_id} ({self.phase})"
