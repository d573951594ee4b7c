"""Issue recovery actions (docs/data-model.md#recovery-actions): at most one live action per source
issue, except the board's holds of runs (`held_run`): one live hold per held run and cause, as
many as the issue has held runs."""

from __future__ import annotations

import uuid
from typing import Any, ClassVar

from django.db import models
from django.db.models import Q
from django.db.models.functions import Now

from paperclip.models import Agent, Company, Issue, TimestampedModel

LIVE_STATUSES = ("active", "escalated")


class IssueRecoveryAction(TimestampedModel):
    class Kind(models.TextChoices):
        MISSING_DISPOSITION = "missing_disposition"
        STRANDED_ASSIGNED_ISSUE = "stranded_assigned_issue"
        WORKSPACE_VALIDATION = "workspace_validation"
        CONFIGURATION_VALIDATION = "configuration_validation"
        ACTIVE_RUN_WATCHDOG = "active_run_watchdog"
        ISSUE_GRAPH_LIVENESS = "issue_graph_liveness"

    class Status(models.TextChoices):
        ACTIVE = "active"
        ESCALATED = "escalated"
        RESOLVED = "resolved"
        CANCELLED = "cancelled"

    class OwnerType(models.TextChoices):
        AGENT = "agent"
        USER = "user"
        BOARD = "board"
        SYSTEM = "system"

    class Outcome(models.TextChoices):
        RESTORED = "restored"
        DELEGATED = "delegated"
        FALSE_POSITIVE = "false_positive"
        BLOCKED = "blocked"
        ESCALATED = "escalated"
        CANCELLED = "cancelled"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    company = models.ForeignKey(Company, on_delete=models.CASCADE, related_name="+")
    source_issue = models.ForeignKey(
        Issue, on_delete=models.CASCADE, related_name="recovery_actions"
    )
    recovery_issue = models.ForeignKey(
        Issue, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    kind = models.TextField(choices=Kind.choices)
    status = models.TextField(choices=Status.choices, default=Status.ACTIVE)
    owner_type = models.TextField(choices=OwnerType.choices, default=OwnerType.AGENT)
    owner_agent = models.ForeignKey(
        Agent, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    owner_user_id = models.TextField(null=True, blank=True)
    previous_owner_agent = models.ForeignKey(
        Agent, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    return_owner_agent = models.ForeignKey(
        Agent, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    cause = models.TextField()
    fingerprint = models.TextField()
    evidence = models.JSONField(default=dict, blank=True)
    next_action = models.TextField()
    wake_policy = models.JSONField(null=True, blank=True)
    monitor_policy = models.JSONField(null=True, blank=True)
    attempt_count = models.IntegerField(default=0)
    max_attempts = models.IntegerField(null=True, blank=True)
    stale = models.BooleanField(default=False)
    timeout_at = models.DateTimeField(null=True, blank=True)
    last_attempt_at = models.DateTimeField(null=True, blank=True)
    resolved_at = models.DateTimeField(null=True, blank=True)
    outcome = models.TextField(choices=Outcome.choices, null=True, blank=True)
    resolution_note = models.TextField(null=True, blank=True)
    # The run a board hold holds (owner unverified, workspace head conflict, export retries
    # spent): such a hold is that run's alone, never superseded by another run's action.
    held_run = models.ForeignKey(
        "paperclip.HeartbeatRun",
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="+",
        db_index=False,  # the partial unique index below serves the lookups
    )

    class Meta:
        db_table = "issue_recovery_actions"
        indexes: ClassVar[list[models.Index]] = [
            models.Index(
                fields=["company", "source_issue", "status"], name="recovery_company_source_idx"
            ),
            models.Index(
                fields=["company", "owner_agent", "status"], name="recovery_company_owner_idx"
            ),
            models.Index(
                fields=["company", "recovery_issue"], name="recovery_company_rec_issue_idx"
            ),
            models.Index(fields=["company", "stale", "status"], name="recovery_company_stale_idx"),
            # The admin list's default order (newest change first, id tie-break); the board's
            # held-finalization count (cause + live status) and the cause filter's choices.
            models.Index(fields=["updated_at", "id"], name="recovery_updated_idx"),
            models.Index(fields=["cause", "status"], name="recovery_cause_status_idx"),
        ]
        constraints: ClassVar[list[Any]] = [
            models.UniqueConstraint(
                fields=["company", "source_issue"],
                condition=Q(status__in=LIVE_STATUSES, held_run__isnull=True),
                name="issue_recovery_actions_active_source_uq",
            ),
            models.UniqueConstraint(
                fields=["company", "held_run", "cause"],
                condition=Q(status__in=LIVE_STATUSES, held_run__isnull=False),
                name="issue_recovery_actions_live_held_run_uq",
            ),
            models.UniqueConstraint(
                fields=["company", "source_issue", "cause", "fingerprint"],
                condition=Q(status__in=LIVE_STATUSES),
                name="issue_recovery_actions_active_fingerprint_uq",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.cause} ({self.status})"


class WorkerStopReceipt(models.Model):
    """A worker platform's signed statement that the worker (and every process it started)
    holding a finalization owner receipt has stopped. Recorded through
    `POST /api/platform/worker-stops` or `manage.py record_worker_stop`; the signature is
    re-verified whenever it is used as a stop proof."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    company = models.ForeignKey(Company, on_delete=models.CASCADE, related_name="+")
    run = models.ForeignKey(
        "paperclip.HeartbeatRun", on_delete=models.CASCADE, related_name="worker_stop_receipts"
    )
    owner_token = models.TextField()
    worker_id = models.TextField()
    stopped_at = models.TextField()  # as signed by the platform (ISO-8601)
    signature = models.TextField()
    recorded_at = models.DateTimeField(db_default=Now(), editable=False)

    class Meta:
        db_table = "worker_stop_receipts"
        constraints: ClassVar[list[Any]] = [
            models.UniqueConstraint(
                fields=["run", "owner_token"], name="worker_stop_receipts_run_token_uq"
            )
        ]

    def __str__(self) -> str:
        return f"stop receipt {self.worker_id} for run {self.run_id}"
