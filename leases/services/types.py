"""The runtime-lease services' constants and the frozen value types they take and return: who
claims (`RuntimeLeaseOwner`, whose `owner_key` names the lane's holder, docs/leases.md#owner-key)
and what claims, releases, fenced writes and sweeps report.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final, Literal
from uuid import UUID

from leases.models import WorkspaceRuntimeLease
from leases.selectors import RuntimeLease, StaleReason

LEASED_ACTIONS: Final[tuple[str, ...]] = tuple(WorkspaceRuntimeLease.Action.values)
TTL_MIN_SECONDS: Final = 60
TTL_MAX_SECONDS: Final = 86_400
BUSY_MESSAGE: Final = "The runtime lease is locked by another request; retry shortly."

ClaimOutcome = Literal["created", "renewed", "reclaimed", "bypassed"]


@dataclass(frozen=True, slots=True)
class RuntimeLeaseOwner:
    """Who claims: the audit actor plus the ids the owner key is derived from."""

    actor_type: Literal["agent", "user", "system"]
    actor_id: str
    agent_id: UUID | None = None
    run_id: UUID | None = None
    issue_id: UUID | None = None

    @classmethod
    def for_agent(
        cls, agent_id: UUID, *, run_id: UUID | None = None, issue_id: UUID | None = None
    ) -> RuntimeLeaseOwner:
        return cls("agent", str(agent_id), agent_id=agent_id, run_id=run_id, issue_id=issue_id)

    @classmethod
    def for_board(cls, user_id: Any) -> RuntimeLeaseOwner:
        return cls("user", str(user_id))

    @property
    def owner_key(self) -> str | None:
        """`issue:<id>`, else `run:<id>`, else `agent:<id>`: the issue outlives any single run,
        so it is the most durable identity in scope (docs/leases.md#owner-key)."""
        if self.issue_id is not None:
            return f"issue:{self.issue_id}"
        if self.run_id is not None:
            return f"run:{self.run_id}"
        if self.agent_id is not None:
            return f"agent:{self.agent_id}"
        return None


@dataclass(frozen=True, slots=True)
class ReclaimedFrom:
    owner_key: str
    reason: StaleReason


@dataclass(frozen=True, slots=True)
class RuntimeLeaseClaim:
    outcome: ClaimOutcome
    owner_key: str | None
    lease: RuntimeLease | None
    reclaimed_from: ReclaimedFrom | None = None


@dataclass(frozen=True, slots=True)
class RuntimeLeaseRelease:
    released: bool
    owner_key: str | None
    lease: RuntimeLease | None = None  # the deleted row, when one was deleted


@dataclass(frozen=True, slots=True)
class WorkspaceOperationRecord:
    id: UUID
    company_id: UUID
    execution_workspace_id: UUID
    heartbeat_run_id: UUID | None
    issue_id: UUID | None
    actor_agent_id: UUID | None
    phase: str
    command: str | None
    status: str
    exit_code: int | None
    lease_generation: int
    started_at: datetime
    finished_at: datetime | None


@dataclass(frozen=True, slots=True)
class RuntimeLeaseSweepBatch:
    examined: int  # candidates handed in
    skipped_locked: int  # held by a concurrent claim/release right now
    survived: int  # locked, but no longer stale on re-check (renewed or reclaimed meanwhile)
    deleted: tuple[tuple[UUID, StaleReason], ...]


@dataclass(slots=True)
class RuntimeLeaseSweepReport:
    dry_run: bool
    batches: int = 0
    examined: int = 0
    skipped_locked: int = 0
    survived: int = 0
    by_reason: Counter[str] = field(default_factory=Counter)
    floors_raised: int = 0  # live leases whose expiry floor moved up (docs/data-model.md)

    @property
    def deleted(self) -> int:
        return sum(self.by_reason.values())
