"""The locked run binding of a finalization (issue → coordinator → run, the global order),
the receipt fence on the locked run, and the run's mirror of its coordinator's phase."""

from __future__ import annotations

from collections.abc import Sequence
from uuid import UUID

from django.conf import settings
from django.db.models.functions import Now

from paperclip.db.locking import require_transaction
from paperclip.models import HeartbeatRun, Issue, NativeRunFinalization
from paperclip.receipts import raw_owner
from recovery.errors import FinalizationBindingMissing, FinalizationOwnershipLost
from recovery.locks import coordinators_for_update, issues_for_update, runs_for_update
from recovery.selectors.actions import run_issue_id
from recovery.services.ownership.lock_connection import FinalizationOwnership

FINALIZER = "native_workspace_finalizer"


def run_phase_mirror(
    run: HeartbeatRun, phase: str, *, also: Sequence[str] = (), touch: bool = True
) -> None:
    """The run mirrors its coordinator's phase: `native_phase` (with when it moved) and
    `result_json.finalizationPhase`, which readers of the run alone look at. `also`: more
    fields the caller set on `run`; `touch`: bump `updated_at` too."""
    run.native_phase = phase
    run.native_phase_updated_at = Now()
    run.result_json = {
        **(run.result_json if isinstance(run.result_json, dict) else {}),
        "finalizationPhase": str(phase),
    }
    fields = ["native_phase", "native_phase_updated_at", "result_json", *also]
    if touch:
        run.updated_at = Now()
        fields.append("updated_at")
    run.save(update_fields=fields)


def max_attempts() -> int:
    return int(getattr(settings, "PAPERCLIP_FINALIZE_MAX_ATTEMPTS", 5))


def run_workspace_id(run: HeartbeatRun, issue: Issue) -> UUID | None:
    return run.execution_workspace_id or issue.execution_workspace_id


def locked_binding(
    *, company_id: UUID, run_id: UUID
) -> tuple[Issue, NativeRunFinalization | None, HeartbeatRun]:
    """Lock issue → coordinator → run (the global order) for a native run with an issue."""
    require_transaction()
    run = HeartbeatRun.objects.filter(pk=run_id, company_id=company_id, runtime_mode="native")
    probe = run.only("id", "native_issue_id", "issue_id", "context_snapshot").first()
    issue_id = run_issue_id(probe) if probe is not None else None
    if probe is None or issue_id is None:
        raise FinalizationBindingMissing(run_id=str(run_id))
    issue = issues_for_update().filter(pk=issue_id, company_id=company_id).first()
    coordinator = coordinators_for_update().filter(run_id=run_id, company_id=company_id).first()
    locked_run = runs_for_update().filter(pk=run_id, company_id=company_id).first()
    if issue is None or locked_run is None:
        raise FinalizationBindingMissing(run_id=str(run_id))
    return issue, coordinator, locked_run


def require_receipt(run: HeartbeatRun, ownership: FinalizationOwnership) -> None:
    """Fence a write on the locked run row: our receipt must still be the run's receipt, so
    nothing is published after ownership moved on (the row lock keeps it stable until
    commit)."""
    receipt = raw_owner(run.runner_profile_json)
    if not isinstance(receipt, dict) or receipt.get("token") != ownership.token:
        raise FinalizationOwnershipLost("owner_replaced")
