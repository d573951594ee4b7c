"""Advisory-lock keys and locking querysets of the recovery app (the only place building them).

Lock order (see paperclip/db/advisory.py): advisory keys first, then issue → coordinator →
run → recovery action rows. Finalization ownership and the owner-stop admission both take this
order (docs/locking.md#lock-order), so the two paths can't deadlock against each other.
"""

from __future__ import annotations

from uuid import UUID

from django.db.models import QuerySet

# The core rows' locking querysets are the core app's; re-exported for recovery callers.
from paperclip.locks import coordinators_for_update, issues_for_update, runs_for_update
from recovery.models import IssueRecoveryAction


def finalization_queueing_lock(run_id: UUID | str) -> str:
    """The Procrastinate queueing lock of a run's finalization jobs: at most one waiting."""
    return f"finalize-run:{run_id}"


def finalization_lock_key(company_id: UUID | str, run_id: UUID | str) -> str:
    """The per-run finalization ownership key shared by controllers, reconcilers and the
    owner-stop confirmation."""
    return f"native-workspace-finalization:{company_id}:{run_id}"


def board_request_key(company_id: UUID | str, run_id: UUID | str) -> str:
    """Serializes the board's requests on a run's hold (owner-stop confirmation, export
    retry): a repeat submitted while the first is in its transaction waits for it, then
    answers as its replay."""
    return f"recovery:board-request:{company_id}:{run_id}"


def recovery_source_key(company_id: UUID | str, issue_id: UUID | str) -> str:
    """Serializes the single writer of an issue's live recovery action."""
    return f"recovery:source-issue:{company_id}:{issue_id}"


def recovery_actions_for_update() -> QuerySet[IssueRecoveryAction]:
    return IssueRecoveryAction.objects.select_for_update(no_key=True, of=("self",)).order_by("pk")


__all__ = [
    "coordinators_for_update",
    "finalization_lock_key",
    "finalization_queueing_lock",
    "issues_for_update",
    "recovery_actions_for_update",
    "recovery_source_key",
    "runs_for_update",
]
