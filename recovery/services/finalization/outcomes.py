"""What one finalization attempt answers (`FinalizeOutcome`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal
from uuid import UUID

from paperclip.models import HeartbeatRun, NativeRunFinalization
from paperclip.snapshots.head import PublishPlan
from recovery.adapters.copyback import CopybackReport


@dataclass(frozen=True, slots=True)
class FinalizeOutcome:
    run_id: UUID
    status: Literal[
        "committed", "already_committed", "retry_scheduled", "retry_exhausted", "not_due", "held"
    ]
    phase: str
    result_id: UUID | None
    run_status: str
    operation_id: UUID | None = None
    copied: CopybackReport | None = None
    failure_code: str | None = None
    published: PublishPlan | None = None


def outcome_of(
    coordinator: NativeRunFinalization,
    run: HeartbeatRun,
    status: Any,
    *,
    operation_id: UUID | None = None,
    copied: CopybackReport | None = None,
    failure_code: str | None = None,
) -> FinalizeOutcome:
    return FinalizeOutcome(
        run_id=run.pk,
        status=status,
        phase=coordinator.phase,
        result_id=coordinator.result_id,
        run_status=run.status,
        operation_id=operation_id,
        copied=copied,
        failure_code=failure_code,
    )
