"""Runtime leases (one exclusive lane per execution workspace) and environment leases."""

from __future__ import annotations

import uuid
from typing import Any, ClassVar

from django.db import models
from django.db.models import Q
from django.db.models.functions import Now

from paperclip.models import (
    Agent,
    Company,
    Environment,
    ExecutionWorkspace,
    HeartbeatRun,
    Issue,
    TimestampedModel,
)


class WorkspaceRuntimeLease(TimestampedModel):
    """docs/data-model.md#runtime-leases. Release deletes the row; reclaim updates it in place. The
    unique execution workspace is the atomicity anchor across server processes."""

    class Action(models.TextChoices):
        START = "start"
        STOP = "stop"
        RESTART = "restart"
        REPAIR = "repair"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    company = models.ForeignKey(Company, on_delete=models.CASCADE, related_name="+")
    execution_workspace = models.OneToOneField(
        ExecutionWorkspace, on_delete=models.CASCADE, related_name="runtime_lease"
    )
    # Text so the owner stays identifiable after the FK columns are nulled.
    owner_key = models.TextField()
    owner_issue = models.ForeignKey(
        Issue, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    owner_run = models.ForeignKey(
        HeartbeatRun, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    owner_agent = models.ForeignKey(
        Agent, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    last_action = models.TextField(choices=Action.choices)
    claimed_at = models.DateTimeField(db_default=Now())
    # The id of the transaction that created or reclaimed it (`pg_current_xact_id()`): the
    # board's bulk force-release leaves alone a lease whose claim its confirmation page's
    # snapshot could not see (committed after it), whatever `claimed_at` (a transaction's
    # start) says. Null for leases claimed before it was kept.
    claimed_xid = models.BigIntegerField(null=True, blank=True, editable=False)
    renewed_at = models.DateTimeField(db_default=Now())
    expires_at = models.DateTimeField()
    metadata = models.JSONField(null=True, blank=True)
    # The grant's fence (docs/leases.md#fence): the PostgreSQL timeline in the bits above 40,
    # the generation below, so a failover that lost the last grants still hands out larger ones.
    fence = models.BigIntegerField(db_default=0)
    generation = models.BigIntegerField(default=1)
    # A lower bound of `expires_at` that a renew leaves alone, so that a renew changes no
    # indexed column and PostgreSQL updates the row in place (a HOT update: none of the
    # table's indexes is written). Set-wide expiry reads find candidates through its index and
    # judge `expires_at` itself; the periodic sweep moves the floors of live leases up. Kept by
    # database triggers (never above `expires_at`), not by Python:
    # docs/data-model.md#expiry-floor.
    expiry_floor = models.DateTimeField(db_default=Now(), editable=False)
    # Whether the owner the key names is missing, hidden or ended: kept by database triggers
    # on this table, issues and runs (docs/data-model.md#owner-stale-marker), never by Python.
    # Only a filter for set-wide stale reads; the verdict itself is judged live.
    owner_stale = models.BooleanField(db_default=False, editable=False)

    class Meta:
        db_table = "execution_workspace_runtime_leases"
        indexes: ClassVar[list[models.Index]] = [
            models.Index(
                fields=["company", "execution_workspace"],
                name="ws_rt_leases_company_ws_idx",
            ),
            models.Index(fields=["company", "owner_key"], name="ws_rt_leases_company_owner_idx"),
            models.Index(fields=["expiry_floor"], name="ws_rt_leases_expiry_floor_idx"),
            models.Index(
                fields=["id"], condition=Q(owner_stale=True), name="ws_rt_leases_owner_stale_idx"
            ),
        ]
        constraints: ClassVar[list[models.BaseConstraint]] = [
            models.CheckConstraint(
                condition=Q(expiry_floor__lte=models.F("expires_at")),
                name="ws_rt_leases_expiry_floor_lte_expires_at",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.owner_key} on {self.execution_workspace_id}"


class EnvironmentLease(TimestampedModel):
    """docs/data-model.md#environment-leases: a provider allocation (sandbox) bound to a run."""

    class Status(models.TextChoices):
        ACTIVE = "active"
        RELEASED = "released"
        EXPIRED = "expired"
        FAILED = "failed"
        RETAINED = "retained"
        PENDING_CLEANUP = "pending_cleanup"

    # Nothing holds the allocation any more / something may still hold it.
    RETIRED_STATUSES: ClassVar[tuple[str, ...]] = ("released", "expired", "failed")
    LIVE_ALLOCATION_STATUSES: ClassVar[tuple[str, ...]] = ("active", "retained", "pending_cleanup")

    class Policy(models.TextChoices):
        EPHEMERAL = "ephemeral"
        REUSE_BY_ENVIRONMENT = "reuse_by_environment"
        REUSE_BY_EXECUTION_WORKSPACE = "reuse_by_execution_workspace"
        RETAIN_ON_FAILURE = "retain_on_failure"

    class CleanupStatus(models.TextChoices):
        PENDING = "pending"
        SUCCESS = "success"
        FAILED = "failed"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    company = models.ForeignKey(Company, on_delete=models.CASCADE, related_name="+")
    environment = models.ForeignKey(
        Environment, on_delete=models.SET_NULL, null=True, blank=True, related_name="leases"
    )
    execution_workspace = models.ForeignKey(
        ExecutionWorkspace, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    issue = models.ForeignKey(
        Issue, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    heartbeat_run = models.ForeignKey(
        HeartbeatRun, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    status = models.TextField(choices=Status.choices, default=Status.ACTIVE)
    lease_policy = models.TextField(choices=Policy.choices, default=Policy.EPHEMERAL)
    provider = models.TextField(null=True, blank=True)
    provider_lease_id = models.TextField(null=True, blank=True)
    acquired_at = models.DateTimeField(db_default=Now())
    last_used_at = models.DateTimeField(db_default=Now())
    expires_at = models.DateTimeField(null=True, blank=True)
    released_at = models.DateTimeField(null=True, blank=True)
    failure_reason = models.TextField(null=True, blank=True)
    cleanup_status = models.TextField(choices=CleanupStatus.choices, null=True, blank=True)
    metadata = models.JSONField(null=True, blank=True)

    class Meta:
        db_table = "environment_leases"
        indexes: ClassVar[list[models.Index]] = [
            models.Index(
                fields=["company", "environment", "status"], name="env_leases_company_env_idx"
            ),
            models.Index(
                fields=["company", "execution_workspace"], name="env_leases_company_ws_idx"
            ),
            models.Index(fields=["company", "issue"], name="env_leases_company_issue_idx"),
            models.Index(fields=["heartbeat_run"], name="env_leases_run_idx"),
            models.Index(fields=["company", "last_used_at"], name="env_leases_company_used_idx"),
            models.Index(fields=["provider_lease_id"], name="env_leases_provider_lease_idx"),
            models.Index(
                fields=["company", "status", "cleanup_status"], name="env_leases_cleanup_idx"
            ),
        ]
        constraints: ClassVar[list[Any]] = [
            models.UniqueConstraint(
                fields=["environment", "execution_workspace"],
                condition=Q(status="active")
                & Q(execution_workspace__isnull=False)
                & Q(lease_policy="ephemeral"),
                name="env_leases_active_ws_singleflight_uq",
            )
        ]

    def __str__(self) -> str:
        return f"{self.provider}:{self.provider_lease_id} ({self.status})"
