"""Core models: companies, board members, agents and their keys, issues, heartbeat runs,
execution workspaces, environments, workspace operations, the native run coordinator and
results, and the activity (audit) log.

Column names follow upstream Paperclip (docs/data-model.md#naming-conventions) where they
correspond, so upstream's maintenance SQL reads the same. State that must change only through
services is kept read-only in the admin.
"""

from __future__ import annotations

import uuid
from typing import Any, ClassVar

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.db.models.functions import Now


class TimestampedModel(models.Model):
    created_at = models.DateTimeField(db_default=Now(), editable=False)
    updated_at = models.DateTimeField(db_default=Now(), editable=False)

    class Meta:
        abstract = True


class Company(TimestampedModel):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=200)

    class Meta:
        db_table = "companies"
        verbose_name_plural = "companies"
        ordering: ClassVar[list[str]] = ["name"]

    def __str__(self) -> str:
        return self.name


class BoardMembership(models.Model):
    """A Django staff user who is a board member (operator) of a company."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="board_memberships"
    )
    company = models.ForeignKey(Company, on_delete=models.CASCADE, related_name="board_members")
    created_at = models.DateTimeField(db_default=Now(), editable=False)

    class Meta:
        db_table = "board_memberships"
        constraints: ClassVar[list[Any]] = [
            models.UniqueConstraint(
                fields=["user", "company"], name="board_memberships_user_company_uq"
            )
        ]

    def __str__(self) -> str:
        return f"{self.user} @ {self.company_id}"


class Agent(TimestampedModel):
    class Status(models.TextChoices):
        ACTIVE = "active"
        PAUSED = "paused"
        TERMINATED = "terminated"

    class Role(models.TextChoices):
        WORKER = "worker"  # runs issues (runs, runtime leases, checkpoints, results)
        PROVIDER = "provider"  # drives environment leases and their cleanups

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    company = models.ForeignKey(Company, on_delete=models.CASCADE, related_name="agents")
    name = models.CharField(max_length=200)
    status = models.TextField(choices=Status.choices, default=Status.ACTIVE)
    role = models.TextField(choices=Role.choices, default=Role.WORKER, db_default=Role.WORKER)

    class Meta:
        db_table = "agents"
        indexes: ClassVar[list[models.Index]] = [
            models.Index(fields=["company", "name"], name="agents_company_name_idx")
        ]

    def __str__(self) -> str:
        return self.name

    # DRF treats the authenticated principal as a user; an agent is always authenticated.
    @property
    def is_authenticated(self) -> bool:
        return True


class ApiCredential(models.Model):
    """Shared shape of agent keys and board tokens: `<kind>_<prefix>.<secret>`, stored as the
    prefix plus a SHA-256 hash of the secret (a slow password hash would sit on every request)."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    prefix = models.CharField(max_length=32, unique=True)
    secret_sha256 = models.CharField(max_length=64)
    name = models.CharField(max_length=200, blank=True, default="")
    created_at = models.DateTimeField(db_default=Now(), editable=False)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        abstract = True

    @property
    def is_revoked(self) -> bool:
        return self.revoked_at is not None


class AgentApiKey(ApiCredential):
    agent = models.ForeignKey(Agent, on_delete=models.CASCADE, related_name="api_keys")

    class Meta:
        db_table = "agent_api_keys"
        verbose_name = "agent API key"

    def __str__(self) -> str:
        return f"pcak_{self.prefix}"


class BoardApiToken(ApiCredential):
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="board_api_tokens"
    )

    class Meta:
        db_table = "board_api_tokens"
        verbose_name = "board API token"

    def __str__(self) -> str:
        return f"pcbt_{self.prefix}"


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


class CasBlob(models.Model):
    """A blob of a company's content-addressed store (docs/snapshots.md#the-store): its name is
    the sha256 of its bytes. The bytes live in the backend (`PAPERCLIP_CAS_BACKEND`): files
    under the data directory, or `CasBlobChunk` rows. `referenced_at` moves whenever an
    upload or a snapshot names the blob; the collector keeps anything younger than the grace."""

    id = models.BigAutoField(primary_key=True)
    company = models.ForeignKey(Company, on_delete=models.CASCADE, related_name="+")
    digest = models.TextField()
    size = models.BigIntegerField()
    created_at = models.DateTimeField(db_default=Now(), editable=False)
    referenced_at = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "cas_blobs"
        constraints: ClassVar[list[models.BaseConstraint]] = [
            models.UniqueConstraint(fields=["company", "digest"], name="cas_blobs_company_digest")
        ]
        indexes: ClassVar[list[models.Index]] = [
            models.Index(fields=["referenced_at"], name="cas_blobs_referenced_idx")
        ]

    def __str__(self) -> str:
        return self.digest


class CasBlobChunk(models.Model):
    """The bytes of a blob in the `postgres` backend, in pieces of at most 1 MiB."""

    id = models.BigAutoField(primary_key=True)
    blob = models.ForeignKey(CasBlob, on_delete=models.CASCADE, related_name="chunks")
    seq = models.IntegerField()
    data = models.BinaryField()

    class Meta:
        db_table = "cas_blob_chunks"
        constraints: ClassVar[list[models.BaseConstraint]] = [
            models.UniqueConstraint(fields=["blob", "seq"], name="cas_blob_chunks_blob_seq")
        ]

    def __str__(self) -> str:
        return f"{self.blob_id}#{self.seq}"


class RunSnapshot(models.Model):
    """A tree a run's agent registered (docs/snapshots.md#snapshots), fenced by the runtime
    lease it held; `base` is the head its checkout started from (null: empty)."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    company = models.ForeignKey(Company, on_delete=models.CASCADE, related_name="+")
    run = models.ForeignKey("HeartbeatRun", on_delete=models.CASCADE, related_name="snapshots")
    execution_workspace = models.ForeignKey(
        ExecutionWorkspace, on_delete=models.CASCADE, related_name="run_snapshots"
    )
    tree = models.TextField()
    base = models.TextField(null=True, blank=True)
    files = models.BigIntegerField()
    bytes = models.BigIntegerField()
    # Entries of every kind (null: registered before this was counted); a later registration
    # compares its tree with a head that has it instead of walking the whole tree.
    entries = models.BigIntegerField(null=True, blank=True)
    lease_generation = models.BigIntegerField()
    created_at = models.DateTimeField(db_default=Now(), editable=False)

    class Meta:
        db_table = "run_snapshots"
        constraints: ClassVar[list[models.BaseConstraint]] = [
            models.UniqueConstraint(fields=["run", "tree"], name="run_snapshots_run_tree")
        ]
        indexes: ClassVar[list[models.Index]] = [
            models.Index(fields=["company", "tree"], name="run_snapshots_company_tree_idx")
        ]

    def __str__(self) -> str:
        return self.tree


class TreeCounts(models.Model):
    """The counts of a tree the workspace publisher built itself (a merge of two runs' trees,
    an adopted cwd), as `run_snapshots` holds them for registered trees: with them, a run
    registering against such a head compares trees instead of walking the whole one
    (docs/snapshots.md#registering-against-the-head). A function of the tree's content, so
    never stale; deleted by collection with the tree's root blob."""

    id = models.BigAutoField(primary_key=True)
    company = models.ForeignKey(Company, on_delete=models.CASCADE, related_name="+")
    tree = models.TextField()
    files = models.BigIntegerField()
    bytes = models.BigIntegerField()
    entries = models.BigIntegerField()  # entries of every kind, the root not counted
    created_at = models.DateTimeField(db_default=Now(), editable=False)

    class Meta:
        db_table = "tree_counts"
        constraints: ClassVar[list[models.BaseConstraint]] = [
            models.UniqueConstraint(fields=["company", "tree"], name="tree_counts_company_tree")
        ]

    def __str__(self) -> str:
        return self.tree


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


class ActivityEvent(models.Model):
    """The audit log: one row per state change, written in the same transaction."""

    class ActorType(models.TextChoices):
        AGENT = "agent"
        USER = "user"
        SYSTEM = "system"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    company = models.ForeignKey(
        Company, on_delete=models.CASCADE, null=True, blank=True, related_name="activity"
    )
    actor_type = models.TextField(choices=ActorType.choices)
    actor_id = models.TextField()
    action = models.TextField()
    entity_type = models.TextField()
    entity_id = models.TextField()
    run = models.ForeignKey(
        HeartbeatRun, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    details = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(db_default=Now(), editable=False)

    class Meta:
        db_table = "activity_events"
        ordering: ClassVar[list[str]] = ["-created_at"]
        indexes: ClassVar[list[models.Index]] = [
            models.Index(fields=["company", "created_at"], name="activity_company_created_idx"),
            models.Index(fields=["entity_type", "entity_id"], name="activity_entity_idx"),
            # Newest first across companies (the console's recent activity, the audit list's
            # default order with its id tie-break), and per action in that order (its filter).
            models.Index(fields=["created_at", "id"], name="activity_created_idx"),
            models.Index(fields=["action", "created_at"], name="activity_action_created_idx"),
            # A staff user's audit list filtered by action or entity type: its count and
            # filter choices read only the matching rows of its companies.
            models.Index(
                fields=["company", "action", "created_at"], name="activity_company_action_idx"
            ),
            models.Index(
                fields=["company", "entity_type", "created_at"], name="activity_company_entity_idx"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.action} {self.entity_type}:{self.entity_id}"


class WorkerProcess(models.Model):
    """A worker process as it registered itself (docs/worker.md#workers-and-their-heartbeats).

    Procrastinate keeps each worker's heartbeat in `procrastinate_workers` (id and time only);
    this row adds where the worker runs, keyed by that same id. A worker that stopped cleanly has
    `stopped_at`; one that vanished keeps its last heartbeat until Procrastinate prunes it.
    """

    worker_id = models.BigIntegerField(primary_key=True)
    hostname = models.TextField()
    pid = models.IntegerField()
    process_started_at = models.DateTimeField()
    # The machine boot it ran under (paperclip/host.py): with the host name, it tells this
    # boot's pid from a reused one. Null when unreadable, and on rows from before it existed.
    kernel_boot_id = models.TextField(null=True, blank=True)
    concurrency = models.IntegerField()
    queues = models.JSONField(default=list, blank=True)  # [] = every queue
    registered_at = models.DateTimeField(db_default=Now(), editable=False)
    stopped_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "worker_processes"
        ordering: ClassVar[list[str]] = ["-registered_at"]
        verbose_name_plural = "worker processes"

    def __str__(self) -> str:
        return f"worker {self.worker_id} on {self.hostname} (pid {self.pid})"


class JobError(models.Model):
    """The exception a job ended with (Procrastinate records only that it failed)."""

    id = models.BigAutoField(primary_key=True)
    job_id = models.BigIntegerField(db_index=True)
    task_name = models.TextField()
    attempt = models.IntegerField()
    error = models.TextField()
    traceback = models.TextField(blank=True, default="")
    worker_id = models.BigIntegerField(null=True, blank=True)
    occurred_at = models.DateTimeField(db_default=Now(), editable=False)

    class Meta:
        db_table = "job_errors"
        ordering: ClassVar[list[str]] = ["-occurred_at"]

    def __str__(self) -> str:
        return f"job {self.job_id} ({self.task_name}): {self.error[:80]}"


from paperclip.snapshots.models import WorkspaceHeadMove  # noqa: E402, F401
