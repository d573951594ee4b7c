"""Typed answers of the API: frozen dataclasses built from the JSON bodies.

Fields follow the API's JSON keys; timestamps become aware `datetime`s. Keys a newer server
adds are ignored, so an old client keeps working; `raw` keeps the whole body.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Union, get_args, get_origin, get_type_hints


def build[T](cls: type[T], data: Any) -> T:
    """An instance of the dataclass `cls` from a JSON object."""
    if not isinstance(data, dict):
        raise TypeError(f"{cls.__name__}: expected a JSON object, got {type(data).__name__}")
    values: dict[str, Any] = {}
    for name, hint, required in _fields(cls):
        if name == "raw":
            values["raw"] = data
        elif name in data:
            values[name] = _convert(hint, data[name])
        elif required:
            values[name] = None
    return cls(**values)


# Each model's fields as (name, resolved type, required), worked out at its first build
# rather than at every one (`get_type_hints` evaluates every annotation's string).
_FIELDS: dict[type, tuple[tuple[str, Any, bool], ...]] = {}


def _fields(cls: type) -> tuple[tuple[str, Any, bool], ...]:
    known = _FIELDS.get(cls)
    if known is None:
        hints = get_type_hints(cls)
        known = tuple(
            (
                f.name,
                hints[f.name],
                f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
            )
            for f in dataclasses.fields(cls)
        )
        _FIELDS[cls] = known  # the same tuple whichever thread got here first
    return known


def _convert(hint: Any, value: Any) -> Any:
    if value is None:
        return None
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        options = [a for a in get_args(hint) if a is not type(None)]
        return _convert(options[0], value) if len(options) == 1 else value
    if origin is list:
        (item,) = get_args(hint)
        return [_convert(item, v) for v in value]
    if origin is dict:
        return dict(value)
    if hint is datetime:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return build(hint, value)
    return value


@dataclass(frozen=True, slots=True)
class Me:
    actor_type: str
    company_ids: list[str]
    agent_id: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)


@dataclass(frozen=True, slots=True)
class Issue:
    id: str
    company_id: str
    title: str
    status: str
    hidden_at: datetime | None
    assignee_agent_id: str | None
    execution_run_id: str | None
    checkout_run_id: str | None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)


@dataclass(frozen=True, slots=True)
class ExecutionWorkspace:
    id: str
    company_id: str
    name: str
    cwd: str | None
    status: str
    raw: dict[str, Any] = field(default_factory=dict, repr=False)


@dataclass(frozen=True, slots=True)
class FinalizationOwner:
    token: str | None
    hostname: str | None
    pid: int | None
    process_started_at: str | None


@dataclass(frozen=True, slots=True)
class RunFinalization:
    state: str
    reason: str | None
    attempts: int
    next_attempt_at: datetime | None
    last_error: str | None


@dataclass(frozen=True, slots=True)
class RunLiveness:
    last_renewed_at: datetime | None
    orphaned_at: datetime | None  # when it became, or would become, orphaned


@dataclass(frozen=True, slots=True)
class Run:
    id: str
    company_id: str
    agent_id: str
    issue_id: str | None
    status: str
    runtime_mode: str
    native_phase: str | None
    execution_workspace_id: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    finalization_owner: FinalizationOwner | None
    finalization: RunFinalization | None
    liveness: RunLiveness | None = None  # a running run's: what keeps it alive, and until when
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    TERMINAL: typing.ClassVar[frozenset[str]] = frozenset(
        {"succeeded", "failed", "cancelled", "timed_out", "interrupted"}
    )

    @property
    def is_terminal(self) -> bool:
        return self.status in self.TERMINAL


@dataclass(frozen=True, slots=True)
class RuntimeLease:
    id: str
    company_id: str
    execution_workspace_id: str
    owner_key: str
    owner_issue_id: str | None
    owner_run_id: str | None
    owner_agent_id: str | None
    last_action: str
    generation: int
    claimed_at: datetime
    renewed_at: datetime
    expires_at: datetime
    metadata: Any = None
    # Strictly increasing over every grant of the workspace (None from a server without it).
    fence: int | None = None


@dataclass(frozen=True, slots=True)
class ReclaimedFrom:
    owner_key: str
    reason: str


@dataclass(frozen=True, slots=True)
class LeaseClaim:
    outcome: str  # created | renewed | reclaimed | bypassed
    owner_key: str | None
    lease: RuntimeLease | None
    reclaimed_from: ReclaimedFrom | None


@dataclass(frozen=True, slots=True)
class LeaseState:
    lease: RuntimeLease | None
    stale_reason: str | None


@dataclass(frozen=True, slots=True)
class LeaseRelease:
    released: bool
    owner_key: str | None


@dataclass(frozen=True, slots=True)
class WorkspaceOperation:
    id: str
    execution_workspace_id: str
    heartbeat_run_id: str | None
    issue_id: str | None
    phase: str
    command: str | None
    status: str
    exit_code: int | None
    lease_generation: int
    started_at: datetime
    finished_at: datetime | None


@dataclass(frozen=True, slots=True)
class ControllerLease:
    lease_owner: str
    controller_boot_id: str
    generation: int
    lease_expires_at: datetime
    outcome: str  # acquired | renewed | taken_over


@dataclass(frozen=True, slots=True)
class CheckpointPart:
    part: str
    size_bytes: int
    key_id: str | None
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True, slots=True)
class NativeResult:
    id: str
    run_id: str
    issue_id: str
    schema_status: str
    caller_result_id: str | None
    server_fingerprint: str
    canonical_sha256: str
    result_json: Any
    created_at: datetime


@dataclass(frozen=True, slots=True)
class Finalize:
    run_id: str
    status: str  # queued | running | retry_scheduled | committed
    finalization: RunFinalization | None

    @property
    def committed(self) -> bool:
        return self.status == "committed"


@dataclass(frozen=True, slots=True)
class RecoveryAction:
    id: str
    kind: str
    status: str
    owner_type: str
    cause: str
    fingerprint: str
    evidence: Any
    next_action: str
    attempt_count: int
    max_attempts: int | None
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True, slots=True)
class EnvironmentLease:
    id: str
    company_id: str
    environment_id: str | None
    execution_workspace_id: str | None
    issue_id: str | None
    heartbeat_run_id: str | None
    status: str
    lease_policy: str
    provider: str | None
    provider_lease_id: str | None
    acquired_at: datetime
    last_used_at: datetime
    released_at: datetime | None
    cleanup_status: str | None
    failure_reason: str | None
    metadata: Any = None


@dataclass(frozen=True, slots=True)
class CleanupClaim:
    attempt_id: str
    expires_at: datetime
    stop_only: bool
    lease: EnvironmentLease


@dataclass(frozen=True, slots=True)
class CasConfig:
    max_blob_bytes: int
    max_batch_bytes: int
    max_batch_blobs: int
    max_find_missing: int = 10_000


@dataclass(frozen=True, slots=True)
class CasPut:
    digest: str
    size: int
    created: bool


@dataclass(frozen=True, slots=True)
class CasBatch:
    stored: list[str]
    existing: list[str]


@dataclass(frozen=True, slots=True)
class Snapshot:
    tree: str
    base: str | None
    files: int
    bytes: int


@dataclass(frozen=True, slots=True)
class WorkspaceHead:
    tree: str | None
    run_id: str | None
    committed_at: datetime | None


@dataclass(frozen=True, slots=True)
class LeaseRenewal:
    """One item's answer of `Client.leases_renew`: the renewed lease (a `RuntimeLease` or a
    `ControllerLease`, as the item's kind), or the error its single endpoint would raise."""

    kind: str  # runtime | controller
    lease: RuntimeLease | ControllerLease | None
    error: Any = None  # an ApiError subclass instance (paperclip_client.errors) when refused

    @property
    def ok(self) -> bool:
        return self.error is None
