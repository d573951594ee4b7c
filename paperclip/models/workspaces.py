"""Where work runs: execution workspaces (with their head in the store), their minimal
snapshots, and environments."""

from __future__ import annotations

import uuid
from typing import ClassVar

from django.db import models
from django.db.models.functions import Now

from paperclip.models.base import TimestampedModel
from paperclip.models.tenancy import Company


class ExecutionWorkspace(TimestampedModel):
    class Status(models.TextChoices):
        ACTIVE = "active"
        ARCHIVED = "archived"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    company = models.ForeignKey(
        Company, on_delete=models.CASCADE, related_name="execution_workspaces"
    )
    source_issue = models.ForeignKey(
        "Issue", on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    mode = models.TextField(default="shared_workspace")
    strategy_type = models.TextField(default="local_directory")
    name = models.TextField()
    status = models.TextField(choices=Status.choices, default=Status.ACTIVE)
    cwd = models.TextField(null=True, blank=True)
    provider_type = models.TextField(default="local_fs")
    provider_ref = models.TextField(null=True, blank=True)
    metadata = models.JSONField(null=True, blank=True)
    # Fencing counter for runtime leases: the last generation handed out for this workspace.
    # It lives here (not on the lease row) so it survives release and re-create.
    runtime_lease_generation = models.BigIntegerField(default=0)
    opened_at = models.DateTimeField(db_default=Now())
    last_used_at = models.DateTimeField(db_default=Now())
    # The workspace's content in the content-addressed store (docs/snapshots.md): the head tree
    # (null: empty), the run that published it and when; `cwd_tree` is the tree the `cwd` was
    # last made equal to (null: unknown or never), so materialization knows what to touch.
    head_tree = models.TextField(null=True, blank=True)
    head_run = models.ForeignKey(
        "HeartbeatRun", on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    head_committed_at = models.DateTimeField(null=True, blank=True)
    cwd_tree = models.TextField(null=True, blank=True)
    # The last failure to materialize the head into the cwd, cleared by a success
    # (docs/snapshots.md#when-materialization-fails): its error, when, how many in a row, and
    # when the reconciler defers the next attempt (back-off).
    materialize_error = models.TextField(null=True, blank=True)
    materialize_failed_at = models.DateTimeField(null=True, blank=True)
    materialize_attempts = models.IntegerField(default=0, db_default=0)
    materialize_next_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "execution_workspaces"
        indexes: ClassVar[list[models.Index]] = [
            models.Index(fields=["company", "status"], name="exec_ws_company_status_idx"),
            models.Index(fields=["company", "source_issue"], name="exec_ws_company_src_issue_idx"),
            # The admin's provider filter reads its choices from it (paperclip.admin.lists).
            models.Index(fields=["provider_type"], name="exec_ws_provider_type_idx"),
        ]

    def __str__(self) -> str:
        return self.name


class ExecutionWorkspaceSnapshot(models.Model):
    """Minimal: a `committed` snapshot is evidence for a saved remote workspace
    (docs/data-model.md#execution-workspaces)."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    company = models.ForeignKey(Company, on_delete=models.CASCADE, related_name="+")
    execution_workspace = models.ForeignKey(
        ExecutionWorkspace, on_delete=models.CASCADE, related_name="snapshots"
    )
    status = models.TextField(default="committed")
    created_at = models.DateTimeField(db_default=Now(), editable=False)

    class Meta:
        db_table = "execution_workspace_snapshots"
        indexes: ClassVar[list[models.Index]] = [
            models.Index(
                fields=["company", "execution_workspace"], name="exec_ws_snap_company_ws_idx"
            )
        ]

    def __str__(self) -> str:
        return f"snapshot {self.id} ({self.status})"


class Environment(TimestampedModel):
    class Driver(models.TextChoices):
        LOCAL = "local"
        SSH = "ssh"
        SANDBOX = "sandbox"
        PLUGIN = "plugin"

    class Status(models.TextChoices):
        ACTIVE = "active"
        ARCHIVED = "archived"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    # Looked up by id (upstream has an instance-scoped variant); scoping goes through the lease.
    company = models.ForeignKey(
        Company, on_delete=models.CASCADE, null=True, blank=True, related_name="environments"
    )
    name = models.TextField()
    description = models.TextField(null=True, blank=True)
    driver = models.TextField(choices=Driver.choices, default=Driver.LOCAL)
    status = models.TextField(choices=Status.choices, default=Status.ACTIVE)
    config = models.JSONField(default=dict, blank=True)
    metadata = models.JSONField(null=True, blank=True)

    class Meta:
        db_table = "environments"
        indexes: ClassVar[list[models.Index]] = [
            models.Index(fields=["company", "status"], name="env_company_status_idx")
        ]

    def __str__(self) -> str:
        return self.name
